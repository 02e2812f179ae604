"""How long a large request holds up a small one on the router's event loop.

The router serves HTTP and gRPC from one event loop, so whatever a request does on
that loop (reading and parsing its body, validating it, tokenizing) delays every other
request meanwhile. Here a client process (the router runs in this one) sends a large
request and, while it is in flight, a /health probe every 10 ms; the baseline is the
same probes with nothing else in flight, in the same run.
  delay = p50 / max of probe latency while the large request is in flight
          - p50 of probe latency alone                          target: max <= ~100 ms
Large requests: over gRPC, 4 MB of token ids and 4 MB of text (under its 4 MiB
message limit); over HTTP, a 10 MB body (over the default 4 MiB limit: refused by its length),
the same 10 MB body with the limit raised to 16 MiB (parsed, then refused because its
text cannot fit the context), a 4 MB text prompt, and a 4 MB list of token ids (the
costliest to parse: about a million integers). Each --repeats times.
Prints JSON and the ratios last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import ray

from pdserve.engine.config import EngineConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch

MB = 1_000_000


def bodies() -> dict:
    from pdserve.v1 import generate_pb2 as pb
    ten = json.dumps({"prompt": "word " * (10 * MB // 5), "max_tokens": 4}).encode()
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300] * (4 * MB // 2)))  # 2 B each
    text = pb.GenerateRequest(text="word " * (4 * MB // 5))
    return {
        "gRPC: 4 MB of token ids (INVALID_ARGUMENT)": ("grpc", ids.SerializeToString()),
        "gRPC: 4 MB text (INVALID_ARGUMENT)": ("grpc", text.SerializeToString()),
        "10 MB text, default limit (413)": ten,
        "10 MB text, 16 MiB limit (400)": ten,
        "4 MB text (400)": json.dumps({"prompt": "word " * (4 * MB // 5)}).encode(),
        "4 MB of token ids (400)": json.dumps({"prompt": [7] * (4 * MB // 3)}).encode(),
    }


async def grpc_generate(target: str, message: bytes) -> str:
    import grpc
    async with grpc.aio.insecure_channel(target, options=[
            ("grpc.max_send_message_length", 16 << 20)]) as channel:
        call = channel.unary_stream("/pdserve.v1.GenerateService/Generate",
                                    request_serializer=lambda b: b)(message, timeout=120)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code().name
        return "OK"


async def probe_while(url: str, body, target: str) -> tuple[list[float], object]:
    """Probe latencies (s) every 10 ms while `body` is posted (or for 2 s without);
    a body of ("grpc", message) goes to the gRPC front end instead."""
    import httpx
    async with httpx.AsyncClient(timeout=120) as http:
        big = None
        if isinstance(body, tuple):
            big = asyncio.ensure_future(grpc_generate(target, body[1]))
        elif body is not None:
            big = asyncio.ensure_future(http.post(f"{url}/v1/completions", content=body,
                                                  headers={"content-type": "application/json"}))
        latencies, end = [], time.monotonic() + 2.0
        while (big is not None and not big.done()) or (big is None and time.monotonic() < end):
            t0 = time.monotonic()
            assert (await http.get(f"{url}/health")).status_code == 200
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(0.01)
        if big is None:
            return latencies, None
        result = await big
        return latencies, result if isinstance(result, str) else result.status_code


def client(url: str, body, target: str, conn) -> None:
    conn.send(asyncio.run(probe_while(url, body, target)))


def run_client(server: RouterServer, body):
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=client, args=(
        server.http_url, body, server.grpc_target, child))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench-results/router_responsiveness.json")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = EngineConfig.from_kwargs(args.model, max_model_len=512, num_threads=1)
    results = {}
    for limit in (4 << 20, 16 << 20):
        router = launch(config, PoolSpec(0, 1, mode="colocated"),
                        router_config=RouterConfig(max_request_bytes=limit))
        server = RouterServer(router)
        alone = [x for _ in range(args.repeats) for x in run_client(server, None)[0]]
        results.setdefault("probe alone p50 ms", {})[f"limit {limit >> 20} MiB"] = \
            1000 * statistics.median(alone)
        for name, body in bodies().items():
            if ("16 MiB" in name) != (limit == 16 << 20) and name.startswith("10 MB"):
                continue
            if limit == 16 << 20 and not name.startswith("10 MB"):
                continue
            delays, statuses = [], set()
            for _ in range(args.repeats):
                latencies, status = run_client(server, body)
                statuses.add(status)
                delays.append((1000 * statistics.median(latencies),
                               1000 * max(latencies)))
            base = 1000 * statistics.median(alone)
            results[name] = {
                "statuses": sorted(statuses),
                "probe p50 ms (median over repeats)": statistics.median(d[0] for d in delays),
                "probe max ms (each repeat)": [round(d[1], 1) for d in delays],
                "added max ms (median over repeats)":
                    statistics.median(d[1] for d in delays) - base}
        server.stop()
        for worker in router.workers.values():
            ray.kill(worker.client.actor)
    ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    for name, r in results.items():
        if isinstance(r, dict) and "added max ms (median over repeats)" in r:
            print(f"{name}: added max delay {r['added max ms (median over repeats)']:.1f} ms "
                  f"(target <= ~100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
