"""A soak: `pdserve serve` (1 prefill + 1 decode worker, local Ray, loopback only)
under steady mixed load for --duration-s (default one hour), sampling every
--sample-s the resident memory, threads and open fds of the router process and of
each worker process (read from /proc: this machine runs them all). What a leak looks
like here is a slope: each series' least-squares slope per hour over the samples
after --warmup-s is printed last, with the series' start and end.

Load: Poisson arrivals at --rate, half through the gRPC SDK (a stream), half as
HTTP SSE completions; prompts of 16-256 random token ids, 16-64 greedy output
tokens; --cancel-share of them dropped by the client after their first tokens (a
gRPC cancel, an HTTP connection closed). Failures are counted by kind; after the
load stops, every worker's KV must be free again (read from the admin API).

    python benchmarks/soak.py                          # one hour
    python benchmarks/soak.py --duration-s 600         # ten minutes
Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.report import save_json
from pdserve.client import AsyncClient

ADMIN_KEY = "soak-admin"


def footprint(pid: int) -> dict | None:
    """RSS (MiB), threads and open fds of one process, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        return {"rss_mib": rss_kib / 1024, "threads": len(os.listdir(f"/proc/{pid}/task")),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (FileNotFoundError, ProcessLookupError, AttributeError):
        return None


def worker_pids() -> list[int]:
    """The processes Ray titled after the worker actor (`ray::WorkerActor...`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::WorkerActor"):
            pids.append(int(entry))
    return sorted(pids)


def slope_per_hour(times: list[float], values: list[float]) -> float | None:
    if len(times) < 2 or max(times) == min(times):
        return None
    return float(np.polyfit(np.asarray(times) / 3600.0, np.asarray(values), 1)[0])


class Serve:
    """`pdserve serve` as a user runs it, on ports the kernel picks."""

    def __init__(self, model: str, kv_mib: int):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", "--model", model, "--host",
             "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--max-model-len", "512",
             "--kv-cache-memory-bytes", str(kv_mib << 20), "--admin-api-key", ADMIN_KEY],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in self.process.stdout:
            found = re.search(r"gRPC (\S+)\s+HTTP (\S+)", line)
            if found:
                self.grpc_target, self.http_url = found.groups()
                return
        raise RuntimeError(f"pdserve serve exited ({self.process.wait()}) before serving")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class Load:
    def __init__(self, serve: Serve, rate: float, cancel_share: float, seed: int):
        self.serve, self.rate, self.cancel_share = serve, rate, cancel_share
        self.rng = random.Random(seed)
        self.counts = {"done": 0, "cancelled": 0}
        self.failures: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()

    async def run(self, until: float) -> None:
        async with AsyncClient(self.serve.grpc_target) as grpc_client, \
                httpx.AsyncClient(base_url=self.serve.http_url, timeout=120) as http:
            loop = asyncio.get_running_loop()
            while loop.time() < until:
                await asyncio.sleep(self.rng.expovariate(self.rate))
                prompt = [self.rng.randrange(4, 200) for _ in range(self.rng.randint(16, 256))]
                max_tokens = self.rng.randint(16, 64)
                cancel_after = (self.rng.randint(1, 8) if self.rng.random() < self.cancel_share
                                else None)
                one = (self._grpc(grpc_client, prompt, max_tokens, cancel_after)
                       if self.rng.random() < 0.5
                       else self._http(http, prompt, max_tokens, cancel_after))
                task = loop.create_task(self._counted(one))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            if self.tasks:
                await asyncio.wait(self.tasks, timeout=180)

    async def _counted(self, one) -> None:
        try:
            self.counts[await one] += 1
        except Exception as exc:  # noqa: BLE001 - counted by kind and reported
            kind = f"{type(exc).__name__}: {str(exc)[:120]}"
            self.failures[kind] = self.failures.get(kind, 0) + 1

    @staticmethod
    async def _grpc(client, prompt, max_tokens, cancel_after) -> str:
        seen = 0
        stream = client.generate_stream(prompt, max_tokens=max_tokens, temperature=0,
                                        ignore_eos=True, timeout=120)
        async for delta in stream:
            seen += len(delta.token_ids)
            if cancel_after is not None and seen >= cancel_after:
                await stream.aclose()  # the call is cancelled
                return "cancelled"
        return "done"

    @staticmethod
    async def _http(http, prompt, max_tokens, cancel_after) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = 0
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}")
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: "):
                    if '"error"' in line:
                        raise RuntimeError("an SSE error event")
                    events += 1
                    if cancel_after is not None and events >= cancel_after:
                        return "cancelled"  # leaving the block closes the connection
        raise RuntimeError("the SSE stream ended without [DONE]")


def kv_free(serve: Serve) -> list[dict]:
    workers = httpx.get(f"{serve.http_url}/admin/workers", timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["workers"]
    return [{"worker_id": w["worker_id"], "free_blocks": w["telemetry"]["free_blocks"],
             "num_blocks": w["telemetry"]["num_blocks"], "running": w["telemetry"]["running"]}
            for w in workers if w.get("telemetry")]


async def soak(args, serve: Serve) -> dict:
    loop = asyncio.get_running_loop()
    start = loop.time()
    load = Load(serve, args.rate, args.cancel_share, args.seed)
    driving = loop.create_task(load.run(start + args.duration_s))
    samples = []
    pids = {"router": serve.process.pid,
            **{f"worker-{i}": pid for i, pid in enumerate(worker_pids())}}
    while True:
        t = loop.time() - start
        sample = {"t_s": round(t, 1), **dict(load.counts),
                  "failed": sum(load.failures.values())}
        for name, pid in pids.items():
            sample[name] = footprint(pid)
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        if driving.done():
            break
        await asyncio.wait({driving}, timeout=args.sample_s)
    driving.result()
    return {"samples": samples, "pids": pids, "counts": load.counts,
            "failures": load.failures}


def slopes(samples: list[dict], names: list[str], warmup_s: float) -> dict:
    out = {}
    kept = [s for s in samples if s["t_s"] >= warmup_s] or samples
    for name in names:
        rows = [(s["t_s"], s[name]) for s in kept if s.get(name)]
        if not rows:
            continue
        out[name] = {}
        for metric in ("rss_mib", "threads", "fds"):
            values = [r[metric] for _, r in rows]
            out[name][metric] = {"start": values[0], "end": values[-1],
                                 "slope_per_hour": slope_per_hour([t for t, _ in rows],
                                                                  values)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--sample-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=120.0,
                    help="samples before this are left out of the slopes")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/soak.json")
    args = ap.parse_args()
    serve = Serve(args.model, args.kv_mib)
    began = time.time()
    try:
        result = asyncio.run(soak(args, serve))
        result["kv_after"] = kv_free(serve)
    finally:
        exit_code = serve.stop()
    result["serve_exit_code"] = exit_code
    result["wall_s"] = round(time.time() - began, 1)
    result["args"] = vars(args)
    result["slopes"] = slopes(result["samples"], list(result["pids"]), args.warmup_s)
    save_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("counts", "failures", "kv_after",
                                             "serve_exit_code")}, indent=2))
    print(f"\nslopes per hour over {result['samples'][-1]['t_s']:.0f} s "
          f"(after {args.warmup_s:g} s of warm-up):")
    for name, metrics in result["slopes"].items():
        print(f"  {name:10s} " + "  ".join(
            f"{metric} {m['start']:.1f}->{m['end']:.1f} ({m['slope_per_hour']:+.2f}/h)"
            for metric, m in metrics.items() if m["slope_per_hour"] is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
