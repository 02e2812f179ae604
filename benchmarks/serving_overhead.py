"""What the router + gRPC path adds over the in-process engine, same run, same workload.

Both sides run one engine with the same settings and thread count: in-process
(LLMEngine.step in this process) and behind the cluster (one colocated engine worker
as a Ray actor, the router, the gRPC server, the SDK's AsyncClient). --rounds batches
of --batch concurrent requests, fresh seeded prompts per round (the same on both
sides, so the prefix cache never helps), greedy, ignore_eos. Each round runs both
sides back to back, in-process first in even rounds and gRPC first in odd ones, so a
drift in this machine's speed (+-8% within minutes) falls on both; the figures are
the medians of the rounds' own, with their spread:
  added TTFT p50 = p50(TTFT through gRPC) - p50(TTFT in-process)       target <= 2 ms
  throughput ratio = output tok/s through gRPC / in-process            target >= 0.95
Also: the added TTFT of one request alone (no batching effects), median of --singles,
and the floor under it on this machine, measured bare in the same run: one Ray actor
call (router -> worker, one way), one item of a Ray streaming generator (worker ->
router) and one gRPC round trip (the Health check). A request's first token crosses
each once.
A batch's TTFT p50 is the end of the engine step that finishes the median prompt, so
a round moves by whole steps when requests reach the engine over several step
boundaries instead of all before the first; rounds are reported one by one for that.

--threads defaults to 1: the cluster side's router, gRPC server and client need CPU of
their own, and on a 2-core machine an engine with 2 threads would measure core
contention rather than the router's overhead (both settings are worth a look).
Prints JSON and the ratios last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.bench.report import show, spread
from pdserve.client import AsyncClient
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import PoolSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch


def workload(n: int, vocab: int, seed: int, prompt_range, max_tokens: int):
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_range))], max_tokens)
            for _ in range(n)]


def single_ttfts_in_process(config: EngineConfig, requests) -> list[float]:
    engine = LLMEngine(config)
    ttfts = []
    for i, (prompt, _) in enumerate(requests):
        t0 = time.time()
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=2, temperature=0,
                                                           ignore_eos=True), arrival_time=t0)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.token_ids:
                    first = time.time() - t0
        ttfts.append(first)
    return ttfts[2:]  # the first two warm up


async def single_ttfts_grpc(target: str, requests) -> list[float]:
    async with AsyncClient(target, timeout=600) as client:
        ttfts = [(await client.generate(p, max_tokens=2, temperature=0, ignore_eos=True)).ttft_s
                 for p, _ in requests]
    return ttfts[2:]


def warmed_engine(config: EngineConfig, warmup) -> LLMEngine:
    engine = LLMEngine(config)
    for i, (prompt, n) in enumerate(warmup):
        engine.add_request(f"warm{i}", prompt, SamplingParams(max_tokens=n, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return engine


def in_process_round(engine: LLMEngine, name: str, requests) -> dict:
    t0 = time.time()
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"{name}-{i}", prompt, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True), arrival_time=t0)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return _round([o.metrics.ttft for o in done], sum(len(o.token_ids) for o in done),
                  time.time() - t0)


async def warmed_client(target: str, warmup) -> AsyncClient:
    """A client made on the running loop (its channel belongs to it), warmed up."""
    client = AsyncClient(target, timeout=600)
    await asyncio.gather(*[client.generate(p, max_tokens=n, temperature=0) for p, n in warmup])
    return client


async def grpc_round(client: AsyncClient, requests) -> dict:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[client.generate(p, max_tokens=n, temperature=0,
                                                  ignore_eos=True) for p, n in requests])
    return _round([o.ttft_s for o in outs], sum(len(o.token_ids) for o in outs),
                  time.perf_counter() - t0)


@ray.remote(num_cpus=0)
class _Probe:
    """The Ray hops a request's first token takes, bare."""

    async def call(self, sent: float) -> float:
        return time.time() - sent

    async def stream(self, n: int, gap_s: float):
        for _ in range(n):
            await asyncio.sleep(gap_s)
            yield time.time()


async def ray_floor(n: int = 50, gap_s: float = 0.01) -> dict:
    """Median one-way latency of an actor call and of a streamed item, from an event
    loop thread as the router's are. Both clocks are this machine's."""
    probe = _Probe.remote()
    calls, items = [], []
    for _ in range(n):
        calls.append(await probe.call.remote(time.time()))
        await asyncio.sleep(gap_s)
    async for ref in probe.stream.remote(n, gap_s):
        items.append(time.time() - await ref)
    ray.kill(probe)
    skip = n // 10  # the first ones warm up
    return {"ray_call_ms": statistics.median(calls[skip:]) * 1e3,
            "ray_stream_item_ms": statistics.median(items[skip:]) * 1e3}


async def grpc_floor(target: str, n: int = 50, gap_s: float = 0.01) -> float:
    """Median round trip of a unary gRPC call (Health.Check) to the router's server."""
    rtts = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(n):
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            rtts.append(time.perf_counter() - t0)
            await asyncio.sleep(gap_s)
    return statistics.median(rtts[n // 10:]) * 1e3


def _round(ttfts: list[float], tokens: int, seconds: float) -> dict:
    return {"ttft_p50_s": statistics.median(ttfts), "output_tokens": tokens,
            "seconds": seconds}


def _tok_s(round_: dict) -> float:
    return round_["output_tokens"] / round_["seconds"]


def _summary(rounds: list[dict]) -> dict:
    tokens, seconds = sum(r["output_tokens"] for r in rounds), sum(r["seconds"] for r in rounds)
    return {"rounds": rounds, "output_tok_s": tokens / seconds, "output_tokens": tokens,
            "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--singles", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/serving_overhead.json")
    args = ap.parse_args()

    config = EngineConfig.from_kwargs(args.model, num_threads=args.threads,
                                      kv_cache_memory_bytes=512 << 20)
    probe = LLMEngine(config)
    vocab = probe.model_config.vocab_size
    del probe
    rounds = [workload(args.batch, vocab, args.seed + 100 * (r + 1), args.prompt_range,
                       args.max_tokens) for r in range(args.rounds)]
    warmup = workload(2, vocab, args.seed, args.prompt_range, 8)
    singles = workload(args.singles, vocab, args.seed + 1, args.prompt_range, 2)
    result = {"batch": args.batch, "rounds": args.rounds, "prompt_range": args.prompt_range,
              "max_tokens": args.max_tokens, "threads": args.threads}
    engine = warmed_engine(config, warmup)
    result["in_process"] = {"single_ttft_ms": statistics.median(
        single_ttfts_in_process(config, singles)) * 1e3}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        router = launch(config, PoolSpec(0, 1, mode="colocated",
                                         num_cpus_per_worker=args.threads))
        server = RouterServer(router)
        with asyncio.Runner() as runner:
            client = runner.run(warmed_client(server.grpc_target, warmup))
            local, remote = [], []  # the rounds in-process, through gRPC
            for r, requests in enumerate(rounds):
                sides = [lambda: local.append(in_process_round(engine, f"r{r}", requests)),
                         lambda: remote.append(runner.run(grpc_round(client, requests)))]
                for side in sides if r % 2 == 0 else sides[::-1]:
                    side()
                print(f"round {r}: output tok/s in-process {_tok_s(local[-1]):.0f}, gRPC "
                      f"{_tok_s(remote[-1]):.0f}", flush=True)
            runner.run(client.close())
        result["in_process"].update(_summary(local))
        result["grpc"] = _summary(remote)
        result["grpc"]["single_ttft_ms"] = statistics.median(
            asyncio.run(single_ttfts_grpc(server.grpc_target, singles))) * 1e3
        floor = asyncio.run_coroutine_threadsafe(ray_floor(), server.loop).result(120)
        floor["grpc_round_trip_ms"] = asyncio.run(grpc_floor(server.grpc_target))
        floor["total_ms"] = sum(floor.values())
        result["floor"] = floor
        server.stop()
    finally:
        ray.shutdown()
    for side in ("in_process", "grpc"):
        print(f"{side}: ttft p50 per round "
              f"{[round(r['ttft_p50_s'] * 1e3) for r in result[side]['rounds']]} ms, "
              f"{result[side]['output_tok_s']:.0f} tok/s", flush=True)

    added = [(g["ttft_p50_s"] - i["ttft_p50_s"]) * 1e3
             for g, i in zip(result["grpc"]["rounds"], result["in_process"]["rounds"])]
    result["added_ttft_p50_ms_per_round"] = added
    result["added_ttft_p50_ms"] = statistics.median(added)
    result["added_single_ttft_ms"] = (result["grpc"]["single_ttft_ms"]
                                      - result["in_process"]["single_ttft_ms"])
    ratios = [_tok_s(g) / _tok_s(i)
              for g, i in zip(result["grpc"]["rounds"], result["in_process"]["rounds"])]
    result["throughput_ratio_per_round"] = ratios
    result["throughput_ratio"] = statistics.median(ratios)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"added TTFT p50 through router + gRPC: {result['added_ttft_p50_ms']:.2f} ms, median "
          f"of rounds {[round(a, 1) for a in added]} (target <= 2)")
    floor = result["floor"]
    print(f"floor of the path on this machine: Ray call {floor['ray_call_ms']:.2f} + Ray stream "
          f"item {floor['ray_stream_item_ms']:.2f} + gRPC round trip "
          f"{floor['grpc_round_trip_ms']:.2f} = {floor['total_ms']:.2f} ms")
    print(f"added TTFT of one request alone: {result['added_single_ttft_ms']:.2f} ms")
    print(f"output throughput ratio gRPC / in-process: "
          f"{show(spread(ratios), 3)} over rounds (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
