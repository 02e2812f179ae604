"""What sharing the request directory in Redis (--redis-url) adds to a request's path,
against the embedded default, in the same run, on a real redis-server on loopback.

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
from pdserve.router.redis_client import connect
from pdserve.router.redis_directory import RedisDirectory
from pdserve.router.request_directory import LocalDirectory

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench-results/replicas.json")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (make test installs it)")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis")))
    server.start()
    try:
        rounds = [asyncio.run(measure(server.url, args)) for _ in range(args.rounds)]
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
                               "round_trips_per_request": {"on_path": 1, "off_path": 1}})
    print(f"wrote {out}")
    for arm, figures in table.items():
        print(f"{arm:9s} claim p50 {show(figures['claim_p50_ms'], 3)} ms, "
              f"p99 {show(figures['claim_p99_ms'], 3)} ms; claim + release p50 "
              f"{show(figures['claim_release_p50_ms'], 3)} ms; "
              f"{show(figures['claims_per_s'], 0)} claims/s at {args.concurrency} in flight")
    print("Redis round trips per request: 1 on its path (claim), at most 1 after it (the "
          "release, batched), plus one renewal per replica every request_ttl_s / 3")
    print(f"added TTFT p50 (redis - embedded claim): {show(added, 3)} ms (goal: <= 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
