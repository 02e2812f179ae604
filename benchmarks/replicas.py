"""What sharing state in Redis (--redis-url) costs router replicas, against the
embedded default, in the same run, on a real redis-server on loopback.

1. The request directory on a request's path (below).
2. Whole routers (`--replicas 1,2,3`): each replica a process running the production
   Router, with the directory and the in-flight load board in Redis, over simulated
   workers through the WorkerClient seam whose steps cost nothing (pdserve/sim: the
   router-bound figure; a pool of simulated workers lives in one process, so each
   replica drives its own copy of the 1P:1D pool). Closed loop: `--clients` requests
   in flight per replica for `--seconds`; completed requests/s of all replicas
   together, and the Redis round trips each replica's client made per request (a
   command or a pipeline each; the subscriptions' incoming messages are not calls).
   On this 2-core machine more than two replicas share cores.

A request's claim is on its path before placement (one round trip, a Lua script); its
release is not (at most one round trip, fired at its end and batched with the others
released meanwhile); renewals cost one round trip per
replica every --request-ttl-s / 3, for all its requests at once. Timed here per
request: claim alone (what TTFT gains) and claim + release (what the router's loop
spends), one request at a time, and with `--concurrency` claims in flight on one
replica. Repeated `--rounds` times for the spread; prints the added TTFT p50 last
(goal: <= 1 ms at p50) and writes JSON."""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from pdserve.bench.report import save_json, show, spread
from pdserve.router.config import SharedStateSpec
from pdserve.router.replicas.redis_client import connect
from pdserve.router.replicas.redis_directory import RedisDirectory
from pdserve.router.replicas.request_directory import LocalDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.redis_server import RedisServer  # noqa: E402  (the tests' real server helper)


async def one_at_a_time(directory, n: int) -> tuple[list[float], list[float]]:
    """Per request: the claim's latency, and claim + release until the release lands."""
    claims, whole = [], []
    for _ in range(n):
        request_id = uuid.uuid4().hex
        began = time.perf_counter()
        assert await directory.claim(request_id, "owner")
        claimed = time.perf_counter()
        directory.release(request_id)
        await _released(directory)
        whole.append(time.perf_counter() - began)
        claims.append(claimed - began)
    return claims, whole


async def concurrent(directory, n: int, concurrency: int) -> float:
    """Claims per second with `concurrency` in flight (each released at once)."""
    ids = iter([uuid.uuid4().hex for _ in range(n)])

    async def client():
        for request_id in ids:
            await directory.claim(request_id, "owner")
            directory.release(request_id)
    began = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    await _released(directory)
    return n / (time.perf_counter() - began)


async def _released(directory) -> None:
    if hasattr(directory, "flushed"):
        await directory.flushed()


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3}


async def measure(url: str, args) -> dict:
    spec = SharedStateSpec(redis_url=url, redis_prefix="bench")
    out = {}
    for name, make in (("embedded", LocalDirectory),
                       ("redis", lambda: RedisDirectory(connect(spec), "bench", "r1",
                                                        spec.request_ttl_s))):
        directory = make()
        await one_at_a_time(directory, 200)  # warm: connections, scripts loaded
        claims, whole = await one_at_a_time(directory, args.requests)
        rate = await concurrent(directory, args.requests, args.concurrency)
        out[name] = {"claim": quantiles(claims), "claim_release": quantiles(whole),
                     "claims_per_s": rate}
        await directory.stop()
    return out


def free_profile():
    """Simulated workers whose steps and transfers take no time: the router is what
    the figure measures (with the simulated workers' own scheduling, in-process)."""
    from pdserve.engine.latency_model import StepCost, TransferCost
    from pdserve.sim.profile import Profile

    zero = StepCost(base_s=0.0, prefill_token_s=0.0, prefill_pair_s=0.0, decode_seq_s=0.0,
                    decode_context_s=0.0)
    return Profile(name="free", source="analytic", step_cost=zero,
                   transfer_cost=TransferCost(latency_s=0.0, per_byte_s=0.0),
                   num_kv_blocks=4096, block_size=16, kv_bytes_per_block=0,
                   max_model_len=2048, vocab_size=32000)


def replica(url: str, index: int, seconds: float, clients: int, start, results) -> None:
    """One replica's process: a Router over its simulated pool (the directory and the
    load board in Redis when url is set), `clients` requests in flight for `seconds`
    once every replica is ready (`start`, a barrier)."""
    from pdserve import SamplingParams
    from pdserve.router.config import PoolSpec, RouterConfig
    from pdserve.router.replicas.pool_registry import LocalRegistry
    from pdserve.sim.cluster import SimCluster

    calls = _count_round_trips()

    async def run() -> tuple[int, int]:
        config = RouterConfig(shared=SharedStateSpec(redis_url=url, redis_prefix="bench"))
        cluster = SimCluster(free_profile(), PoolSpec(1, 1), config,
                             router_id=f"replica-{index}", registry=LocalRegistry())
        router = await cluster.start()
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        prompt = list(range(100, 164))
        done = 0
        await asyncio.to_thread(start.wait)
        deadline = time.perf_counter() + seconds
        calls_before = calls[0]

        async def client(c: int) -> None:
            nonlocal done
            n = 0
            while time.perf_counter() < deadline:
                accepted = await router.accept(prompt, params, f"{index}-{c}-{n}")
                async for _ in router.generate(accepted):
                    pass
                n += 1
                done += 1
        await asyncio.gather(*[client(c) for c in range(clients)])
        trips = calls[0] - calls_before
        await cluster.stop()
        return done, trips
    results.put((index, *asyncio.run(run())))


def _count_round_trips() -> list[int]:
    """Counts, in this process, every call redis-py's asyncio client sends (a command,
    or a pipeline as one)."""
    from redis.asyncio.client import Pipeline, Redis

    calls = [0]

    def counted(send):
        async def call(self, *args, **kwargs):
            calls[0] += 1
            return await send(self, *args, **kwargs)
        return call
    Redis.execute_command = counted(Redis.execute_command)
    Pipeline.execute = counted(Pipeline.execute)
    return calls


def throughput(url: str, replicas: int, args) -> dict:
    """Completed requests/s of `replicas` processes together, and (with Redis) the
    commands Redis served per request."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(replicas), ctx.Queue()
    processes = [ctx.Process(target=replica, args=(url, i, args.seconds, args.clients,
                                                   start, results))
                 for i in range(replicas)]
    for p in processes:
        p.start()
    done = [results.get(timeout=args.seconds + 120)[1:] for _ in processes]
    for p in processes:
        p.join(timeout=60)
    total = sum(n for n, _ in done)
    out = {"replicas": replicas, "requests": total, "per_s": total / args.seconds}
    if url:
        out["redis_round_trips_per_request"] = sum(t for _, t in done) / max(total, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replicas", default="1,2,3",
                    help="replica counts of the whole-router figure ('' skips it)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=32, help="in flight per replica")
    ap.add_argument("--out", default="bench-results/replicas.json")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (make test installs it)")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis")))
    server.start()
    counts = [int(n) for n in args.replicas.split(",") if n]
    try:
        rounds = [asyncio.run(measure(server.url, args)) for _ in range(args.rounds)]
        whole = [{"embedded": throughput("", 1, args),
                  **{f"redis x{n}": throughput(server.url, n, args) for n in counts}}
                 for _ in range(args.rounds if counts else 0)]
    finally:
        server.kill()
    table = {arm: {"claim_p50_ms": spread([r[arm]["claim"]["p50_ms"] for r in rounds]),
                   "claim_p99_ms": spread([r[arm]["claim"]["p99_ms"] for r in rounds]),
                   "claim_release_p50_ms": spread([r[arm]["claim_release"]["p50_ms"]
                                                   for r in rounds]),
                   "claims_per_s": spread([r[arm]["claims_per_s"] for r in rounds])}
             for arm in ("embedded", "redis")}
    added = spread([r["redis"]["claim"]["p50_ms"] - r["embedded"]["claim"]["p50_ms"]
                    for r in rounds])
    out = save_json(args.out, {"args": vars(args), "rounds": rounds, "table": table,
                               "added_ttft_p50_ms": added,
                               "round_trips_per_request": {"on_path": 1, "off_path": 1},
                               "routers": whole})
    print(f"wrote {out}")
    for arm, figures in table.items():
        print(f"{arm:9s} claim p50 {show(figures['claim_p50_ms'], 3)} ms, "
              f"p99 {show(figures['claim_p99_ms'], 3)} ms; claim + release p50 "
              f"{show(figures['claim_release_p50_ms'], 3)} ms; "
              f"{show(figures['claims_per_s'], 0)} claims/s at {args.concurrency} in flight")
    print("Redis round trips per request: at most 1 on its path (the claim; claims made "
          "while one is under way share the next call), at most 1 after it (the release, "
          "batched likewise), plus one renewal per replica every request_ttl_s / 3")
    if whole:
        for arm in whole[0]:
            rate = spread([r[arm]["per_s"] for r in whole])
            trips = spread([r[arm].get("redis_round_trips_per_request") for r in whole])
            print(f"routers {arm:10s} {show(rate, 0)} requests/s"
                  + (f", {show(trips, 2)} Redis round trips per request"
                     if arm != "embedded" else ""))
        one = spread([r["redis x1"]["per_s"] / r["embedded"]["per_s"] for r in whole
                      if "redis x1" in r])
        print(f"one router, redis on / off: {show(one, 3)}x requests/s")
        for n in counts[1:]:
            ratio = spread([r[f"redis x{n}"]["per_s"] / r["redis x1"]["per_s"] for r in whole])
            print(f"{n} replicas / 1 (requests/s, all together): {show(ratio, 2)}x")
    print(f"added TTFT p50 (redis - embedded claim): {show(added, 3)} ms (goal: <= 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
