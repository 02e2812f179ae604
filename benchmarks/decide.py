"""How long the router's per-request decision takes: its real snapshot of the pool
plus decide (Placer.decide: the workers' states, the lazily computed TPOT budgets of
its running requests, the prefix index, the policy), at 10, 100 and 1,000 workers,
for the goodput policy (a forecast per candidate) and the least-loaded one. Half
prefill, half decode workers, loads drawn at random (seeded), each decode worker
running --running requests of this router's with a TPOT SLO. No worker is called:
their clients are stand-ins. Besides the quiet case, two busy ones: every worker
reported since the last decision, and every running request was sent a token since
(their TPOT budgets moved). Target: the goodput decision under 1 ms at 1,000
workers. Medians over --repeats calls after a warm-up, with the spread (p10-p90);
prints JSON, then each size's decision time as a fraction of the 1 ms budget last;
writes --out."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.latency_model import DEFAULT_STEP_COST
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig, RoutingSpec
from pdserve.router.lifecycle import Accepted, Flight
from pdserve.router.model_info import ModelInfo
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.router import Router
from pdserve.router.slo import Slo
from pdserve.worker.messages import WorkerTelemetry

BUDGET_S = 1e-3
SLO = Slo(ttft_s=2.0, tpot_s=0.2)


class Unreachable:
    """A worker the benchmark never calls."""

    def __getattr__(self, name):
        raise AssertionError(f"the benchmark called {name}")


def router(n: int, running: int, policy: str, rng: random.Random, tok: Tokenizer) -> Router:
    now = time.monotonic()
    handles = []
    for i in range(n):
        role = "prefill" if i < n // 2 else "decode"
        handle = WorkerHandle.of(f"w{i}", Unreachable(), role, num_blocks=1000)
        report = WorkerTelemetry(
            worker_id=handle.worker_id, role=role, time=time.time(),
            waiting=rng.randrange(8), waiting_tokens=rng.randrange(4000),
            running=rng.randrange(64), context_tokens=rng.randrange(60000),
            reserved=rng.randrange(8), free_blocks=rng.randrange(1000), num_blocks=1000,
            num_preemptions=0, max_num_seqs=SchedulerConfig.max_num_seqs)
        handle.update(telemetry=report, heard_at=now, step_cost=DEFAULT_STEP_COST,
                      queued=rng.randrange(4), queued_tokens=rng.randrange(4000))
        if role == "decode":
            for j in range(running):
                flight = Flight(_accepted(f"{handle.worker_id}-r{j}", 700))
                flight.first_token_at = time.time()
                flight.output_token_ids = [0] * rng.randrange(100)
                handle.hold(flight)
        handles.append(handle)
    config = RouterConfig(routing=RoutingSpec(routing_policy=policy))
    return Router(tok, ModelInfo("m", 8192, tok.vocab_size, 16, 1000), handles, config)


def _accepted(request_id: str, prompt_tokens: int) -> Accepted:
    return Accepted(request_id=request_id, prompt_token_ids=list(range(4, 4 + prompt_tokens)),
                    params=SamplingParams(max_tokens=128), arrival_time=time.time(), slo=SLO)


def timed(fn, repeats: int, setup=None) -> dict:
    """fn's time, setup (if any) run before each call and not timed."""
    for _ in range(min(repeats, 100)):
        setup and setup()
        fn()
    samples = []
    for _ in range(repeats):
        setup and setup()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    q = statistics.quantiles(samples, n=10)
    return {"median_us": 1e6 * statistics.median(samples), "p10_us": 1e6 * q[0],
            "p90_us": 1e6 * q[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--running", type=int, default=16,
                    help="this router's timed requests on each decode worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/decide.json")
    args = ap.parse_args()
    tok = Tokenizer(resolve_model_path("tiny"))
    results = {}
    for n in (10, 100, 1000):
        results[n] = {}
        for policy in ("goodput", "least-loaded"):
            r = router(n, args.running, policy, random.Random(args.seed), tok)
            req = _accepted("placed", 700)
            results[n][policy] = timed(lambda: r.placer.decide(req), args.repeats)
            # every worker reported since the last decision (a new state each, made
            # before the timer starts: the router's cost, not the benchmark's copies)
            workers = list(r.workers.values())

            def reports():
                for w in workers:
                    w.state = replace(w.state)
            results[n][f"{policy}_all_reported"] = timed(lambda: r.placer.decide(req),
                                                         args.repeats // 4, setup=reports)
            # a busy cluster: every running request was sent a token since the last
            # decision (what the router does as tokens stream), each budget moved
            flights = [(w, f) for w in workers for f in w.flights.values()]

            def tokens():
                for w, f in flights:
                    f.output_token_ids.append(0)
                    w.progressed(f)
            results[n][f"{policy}_tokens_sent"] = timed(lambda: r.placer.decide(req),
                                                        args.repeats // 4, setup=tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    for n, r in results.items():
        share = r["goodput"]["median_us"] * 1e-6 / BUDGET_S
        print(f"{n} workers: snapshot + goodput decide {r['goodput']['median_us']:.1f} us = "
              f"{share:.3f} of the 1 ms budget (every worker reported since: "
              f"{r['goodput_all_reported']['median_us']:.1f} us; every running request "
              f"sent a token since: {r['goodput_tokens_sent']['median_us']:.1f} us; least-loaded "
              f"{r['least-loaded']['median_us']:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
