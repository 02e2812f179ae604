"""How long the one decision point takes: decide(request, ClusterState) at 10, 100
and 1,000 workers, for the goodput policy (a forecast per candidate) and the
least-loaded one (half prefill, half decode; loads drawn at random, seeded), and the
snapshot the router builds for it (each worker's state is cached between changes,
as in the router, where most workers change less often than requests arrive; the
worst case, every worker changed since the last request, is timed too). Target: the goodput decide under 1 ms at 1,000 workers.
Medians over --repeats calls after a warm-up, with the spread (p10-p90); prints JSON,
then each size's decide time as a fraction of the 1 ms budget last; writes --out."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pdserve.engine.worker_messages import WorkerTelemetry
from pdserve.router.cluster_state import ClusterState, RequestView
from pdserve.router.policy import decide
from pdserve.router.slo import Slo
from pdserve.router.workers import WorkerHandle

BUDGET_S = 1e-3


def handles(n: int, rng: random.Random) -> list[WorkerHandle]:
    """Half prefill, half decode workers, each with a fresh telemetry report."""
    workers = []
    for i in range(n):
        role = "prefill" if i < n // 2 else "decode"
        worker = WorkerHandle(f"w{i}", None, role, num_blocks=1000,
                              queued=rng.randrange(4), queued_tokens=rng.randrange(4000),
                              inflight=rng.randrange(64))
        worker.heard(WorkerTelemetry(worker.worker_id, role, time.time(), rng.randrange(8),
                                     rng.randrange(4000), rng.randrange(64),
                                     rng.randrange(60000), rng.randrange(8),
                                     rng.randrange(1000), 1000, 0))
        workers.append(worker)
    return workers


def timed(fn, repeats: int) -> dict:
    for _ in range(min(repeats, 100)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    q = statistics.quantiles(samples, n=10)
    return {"median_us": 1e6 * statistics.median(samples), "p10_us": 1e6 * q[0],
            "p90_us": 1e6 * q[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/decide.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    request = RequestView(num_prompt_tokens=700, blocks_needed=44, max_tokens=128,
                          slo=Slo(ttft_s=2.0, tpot_s=0.2))
    results = {}
    for n in (10, 100, 1000):
        workers = handles(n, rng)

        def snapshot() -> ClusterState:
            return ClusterState(tuple(w.state() for w in workers), time.monotonic(), 5.0,
                                32768, 1.0)
        def snapshot_all_changed() -> ClusterState:
            for w in workers:  # every worker's cached state dropped
                w.inflight = w.inflight
            return snapshot()
        state = snapshot()
        results[n] = {"decide": timed(lambda: decide(request, state), args.repeats),
                      "decide_least_loaded": timed(lambda: decide(request, state,
                                                                  "least-loaded"),
                                                   args.repeats),
                      "snapshot": timed(snapshot, args.repeats),
                      "snapshot_all_changed": timed(snapshot_all_changed, args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    for n, r in results.items():
        share = r["decide"]["median_us"] * 1e-6 / BUDGET_S
        print(f"{n} workers: goodput decide {r['decide']['median_us']:.1f} us = {share:.3f} "
              f"of the 1 ms budget (least-loaded {r['decide_least_loaded']['median_us']:.1f} "
              f"us; snapshot {r['snapshot']['median_us']:.1f} us cached, "
              f"{r['snapshot_all_changed']['median_us']:.1f} us with every worker changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
