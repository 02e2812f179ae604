"""The routing judgments, made in the simulator (`pdserve sim`) at GPU scale, where
this machine's two CPU cores cannot make them (the same real-cluster A/B read 0.99x
and 1.47x in two runs). Every arm is the production router and policy over
simulated workers (an analytic H100 / Llama-3-8B profile by default), each judged
over --seeds seeds (workload and arrivals), with the spread.

Sections (--sections):
  modes      adaptive / the best fixed mode (colocated, or the best P:D split of
             --splits): goodput per worker (the highest rate with >= 90% SLO
             attainment, searched as `pdserve sim plan` searches), per workload
  policies   goodput / least-loaded / round-robin, adaptive, a bursty 50/50 mix
  overload   at 3x the adaptive goodput rate: goodput with admission slo / always
  prefix     multi-turn conversations on --workers colocated workers: TTFT p50 with
             the prefix index / without it (admission always: every request placed)
Prints each judgment's median and [min, max] over the seeds last; writes JSON."""
from __future__ import annotations

import argparse
import random
import sys
import time

from pdserve.bench.metrics import SLO
from pdserve.bench.report import save_json, show, spread
from pdserve.bench.workloads import make_workload
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.sim.analytic import NAMED_CONFIGS, analytic_profile
from pdserve.sim.driver import Load
from pdserve.sim.plan import max_rate
from pdserve.sim.profile import Profile
from pdserve.sim.run import Setup, simulate


class Judge:
    def __init__(self, args, profile: Profile):
        self.args, self.profile = args, profile
        self.slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
        # (arm, workload) -> the first seed's rate: later seeds search around it
        self.found: dict[tuple, float] = {}

    def workload(self, name: str, seed: int):
        """n -> n requests of the workload (a 50/50 mix interleaves azure-conv and
        azure-code), drawn from `seed`."""
        def make(n: int):
            if name != "mix":
                return make_workload(name, n, self.profile.vocab_size, seed, self.args.scale)
            half = n // 2
            both = (make_workload("azure-conv", half, self.profile.vocab_size, seed,
                                  self.args.scale)
                    + make_workload("azure-code", n - half, self.profile.vocab_size,
                                    seed + 1000, self.args.scale))
            random.Random(seed).shuffle(both)
            return both
        return make

    def setup(self, pools: PoolSpec, routing: RoutingSpec = RoutingSpec(),
              seed: int = 0) -> Setup:
        return Setup(profile=self.profile, pools=pools, router=RouterConfig(routing=routing),
                     seed=seed)

    def goodput(self, pools: PoolSpec, name: str, seed: int, routing: RoutingSpec = RoutingSpec(),
                burstiness: float = 1.0) -> float:
        """Goodput per worker: the highest rate with >= 90% attainment, per worker. The
        first seed's search doubles from --first-rate-per-worker; later seeds' start at
        --near x its rate and grow by 1 + --near (--iterations bisections each)."""
        args = self.args
        arm = (pools, routing, name, burstiness)
        known = self.found.get(arm)
        first, growth = ((args.first_rate_per_worker * args.workers, 2.0) if not known
                         else (known * (1 - args.near), 1 + args.near))
        found = max_rate(self.setup(pools, routing, seed), self.workload(name, seed),
                         Load(seed=seed, slo=self.slo, burstiness=burstiness),
                         first_rate=first, iterations=args.iterations,
                         min_requests=args.min_requests, min_duration_s=args.min_duration,
                         growth=growth)
        if found.max_rate:
            self.found.setdefault(arm, found.max_rate)
        return found.max_rate / args.workers


def modes(judge: Judge, args) -> tuple[dict, list[str]]:
    n = args.workers
    shapes = {"colocated": PoolSpec(0, n, mode="colocated"),
              "adaptive": PoolSpec(0, n, mode="adaptive"),
              **{f"{p}P:{n - p}D": PoolSpec(p, n - p) for p in args.splits}}
    section, lines = {}, []
    for name in args.workloads:
        per_seed = {shape: [] for shape in shapes}
        for seed in args.seeds:
            for shape, pools in shapes.items():
                per_seed[shape].append(judge.goodput(pools, name, seed))
            print(f"  {name} seed {seed}: " + ", ".join(
                f"{s} {v[-1]:.2f}" for s, v in per_seed.items()), flush=True)
        fixed = [max(v[i] for s, v in per_seed.items() if s != "adaptive")
                 for i in range(len(args.seeds))]
        best_fixed = [max((s for s in per_seed if s != "adaptive"),
                          key=lambda s: per_seed[s][i]) for i in range(len(args.seeds))]
        ratio = [a / f if f else None for a, f in zip(per_seed["adaptive"], fixed)]
        section[name] = {"goodput_per_worker": {s: spread(v) for s, v in per_seed.items()},
                         "best_fixed": best_fixed, "adaptive_over_best_fixed": spread(ratio)}
        lines.append(f"modes, {name}: adaptive / best fixed mode ({', '.join(best_fixed)}): "
                     f"{show(spread(ratio))}x; per worker adaptive "
                     f"{show(spread(per_seed['adaptive']))} req/s")
    return section, lines


def policies(judge: Judge, args) -> tuple[dict, list[str]]:
    pools = PoolSpec(0, args.workers, mode="adaptive")
    arms = {p: [] for p in ("goodput", "least-loaded", "round-robin")}
    for seed in args.seeds:
        for policy in arms:
            arms[policy].append(judge.goodput(pools, "mix", seed,
                                              RoutingSpec(routing_policy=policy), 0.25))
        print(f"  policies seed {seed}: " + ", ".join(f"{p} {v[-1]:.2f}"
                                                    for p, v in arms.items()), flush=True)
    over = {p: spread([g / o if o else None for g, o in zip(arms["goodput"], arms[p])])
            for p in ("least-loaded", "round-robin")}
    return ({"goodput_per_worker": {p: spread(v) for p, v in arms.items()}, "ratios": over},
            [f"policies, bursty mix: goodput / {p}: {show(r)}x" for p, r in over.items()])


def overload(judge: Judge, args) -> tuple[dict, list[str]]:
    pools = PoolSpec(0, args.workers, mode="adaptive")
    arms = {"slo": [], "always": []}
    rates = []
    for seed in args.seeds:
        rate = 3 * judge.goodput(pools, "azure-conv", seed) * args.workers
        rates.append(rate)
        requests = judge.workload("azure-conv", seed)(max(args.min_requests,
                                                          int(rate * args.min_duration)))
        for arm in arms:
            summary = simulate(judge.setup(pools, RoutingSpec(admission=arm), seed), requests,
                               Load(request_rate=rate, seed=seed, slo=judge.slo))
            arms[arm].append(summary["goodput"] / args.workers)
        print(f"  overload seed {seed} at {rate:.1f} req/s: "
              + ", ".join(f"{a} {v[-1]:.2f}" for a, v in arms.items()), flush=True)
    ratio = spread([s / a if a else None for s, a in zip(arms["slo"], arms["always"])])
    return ({"rate": spread(rates), "goodput_per_worker": {a: spread(v) for a, v in arms.items()},
             "slo_over_always": ratio},
            [f"3x overload: goodput admission slo / always: {show(ratio)}x"])


def prefix(judge: Judge, args) -> tuple[dict, list[str]]:
    pools = PoolSpec(0, args.workers, mode="colocated")
    arms = {"aware": [], "blind": []}
    hits = {"aware": [], "blind": []}
    for seed in args.seeds:
        rate = args.prefix_rate_per_worker * args.workers
        requests = judge.workload("conversations", seed)(max(args.min_requests,
                                                              int(rate * args.min_duration)))
        for arm, aware in (("aware", True), ("blind", False)):
            summary = simulate(judge.setup(pools, RoutingSpec(admission="always",
                                                              prefix_aware=aware), seed),
                               requests, Load(request_rate=rate, seed=seed, slo=judge.slo))
            arms[arm].append(summary["ttft_ms"]["p50"])
            hits[arm].append(summary["prefix_hit_share"])
        print(f"  prefix seed {seed}: TTFT p50 aware {arms['aware'][-1]:.1f} ms, blind "
              f"{arms['blind'][-1]:.1f} ms; cached {hits['aware'][-1]:.0%} / "
              f"{hits['blind'][-1]:.0%}", flush=True)
    ratio = spread([b / a if a else None for a, b in zip(arms["aware"], arms["blind"])])
    return ({"ttft_p50_ms": {a: spread(v) for a, v in arms.items()},
             "prefix_hit_share": {a: spread(v) for a, v in hits.items()},
             "blind_over_aware": ratio},
            [f"prefix, conversations on {args.workers} workers: TTFT p50 blind / aware: "
             f"{show(ratio)}x; prompt tokens cached {show(spread(hits['aware']))} vs "
             f"{show(spread(hits['blind']))}"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+",
                    default=["modes", "policies", "overload", "prefix"])
    ap.add_argument("--profile", default=None,
                    help="a profile file (default: analytic Llama-3-8B on an H100)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 6, 8, 10, 12],
                    help="modes: the P of each P:D split tried (of --workers)")
    ap.add_argument("--workloads", nargs="+",
                    default=["azure-conv", "azure-code", "sharegpt-like", "conversations"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--first-rate-per-worker", type=float, default=2.0)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--near", type=float, default=0.2,
                    help="later seeds search from (1 - near) x the first seed's rate")
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument("--min-duration", type=float, default=20.0)
    ap.add_argument("--prefix-rate-per-worker", type=float, default=4.0)
    ap.add_argument("--out", default="bench-results/routing_sim.json")
    args = ap.parse_args()
    profile = Profile.load(args.profile) if args.profile else analytic_profile(
        "llama-3-8b", NAMED_CONFIGS["llama-3-8b"], "h100")
    judge = Judge(args, profile)
    results = {"args": vars(args), "profile": profile.name, "sections": {}}
    lines = []
    began = time.perf_counter()
    for name, fn in (("modes", modes), ("policies", policies), ("overload", overload),
                     ("prefix", prefix)):
        if name in args.sections:
            print(f"{name} ({time.perf_counter() - began:.0f} s)", flush=True)
            results["sections"][name], more = fn(judge, args)
            lines += more
    out = save_json(args.out, results)
    print(f"wrote {out} ({time.perf_counter() - began:.0f} s)")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
