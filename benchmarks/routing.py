"""The goodput brain against its baselines: the same cluster size (two workers), the
same workload and the same SLOs, every arm in one run, each repeated --rounds times.

Sections (--sections):
  adaptive   adaptive mode (goodput policy, free to colocate or split) / the better of
             always-colocated (2 workers in role both) and always-disaggregated
             (1 prefill + 1 decode): goodput (the highest request rate per worker with
             >= 90% SLO attainment, from a rate sweep), per workload and arrival shape
  policies   goodput / least-loaded / round-robin in adaptive mode, bursty mix
  prefix     multi-turn conversations (about 37% of prompt blocks seen before, as in
             Mooncake's trace; or --prefix-workload prefix-shared): TTFT p50 with the
             prefix index / without it, colocated, each worker's KV cache --prefix-kv-mib,
             every request placed (admission always, so refusals hide no slow ones)
  overload   3x the adaptive goodput rate for --overload-s: goodput with --admission
             slo (waits for capacity bounded by the TTFT SLO, or also by
             --overload-max-wait-ms) / always, and how fast rejections are answered
SLOs are set relative to isolated latencies as `pdserve bench compare` does. Every
goodput arm also reports the forecast's error (median and p90 of |predicted -
measured| / measured). Prints the ratios last; writes JSON to --out."""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import ray

from pdserve.bench import driver
from pdserve.bench.compare import measure_isolated, slo_for
from pdserve.bench.metrics import summarize
from pdserve.bench.report import save_json, spread
from pdserve.bench.sweep import sweep
from pdserve.bench.workloads import make_workload, seen_block_share
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch

MODES = {"adaptive": PoolSpec(1, 1, mode="adaptive"),
         "colocated": PoolSpec(1, 1, mode="colocated"),
         "disaggregated": PoolSpec(1, 1, mode="disaggregated")}


class Cluster:
    """Two workers of `mode` behind a router with `routing`, on a fresh local Ray."""

    def __init__(self, config: EngineConfig, mode: str, routing: RoutingSpec):
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        router = launch(config, MODES[mode], router_config=RouterConfig(routing=routing))
        self.server = RouterServer(router)

    def __enter__(self) -> RouterServer:
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.stop()
        ray.shutdown()


def workload_fn(name: str, args, vocab: int):
    """Run i's requests: a 50/50 mix interleaves azure-conv and azure-code."""
    def make(kind: str, n: int, seed: int):
        return make_workload(kind, n, vocab, seed, args.scale, input_len=args.input_len,
                             output_len=args.output_len, prefix_share=args.prefix_share)

    def workload(i: int):
        seed = args.seed + 1 + i
        if name != "mix":
            return make(name, args.num_prompts, seed)
        half = args.num_prompts // 2
        both = make("azure-conv", half, seed) + make("azure-code", args.num_prompts - half,
                                                     seed + 1000)
        random.Random(seed).shuffle(both)
        return both
    return workload


def run_sweep(config, mode, routing, workload, rates, slo, burstiness, seed) -> dict:
    with Cluster(config, mode, routing) as server:
        cfg = driver.RunConfig("grpc", server.grpc_target, burstiness=burstiness, seed=seed,
                               progress=False, slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms)
        result = asyncio.run(sweep(workload, cfg, rates, slo, num_workers=2))
        result["decisions"] = decisions(server)
        print(f"  {mode} decisions: {result['decisions']}", flush=True)
    for row in result["rows"]:
        print(f"  {mode} {routing.routing_policy}/{routing.admission}: rate {row['rate']:g} "
              f"attainment {row['slo_attainment']:.2f} rejected {row['rejected']} ttft p50 "
              f"{row['ttft_ms']['p50']} tpot p50 {row['tpot_ms']['p50']} forecast error "
              f"{row['prediction_error']}", flush=True)
    return result


def decisions(server: RouterServer) -> dict[str, float]:
    """The router's placement decisions by kind and reason, its waits, and per
    placement kind the forecast's mean signed error ((predicted - measured) /
    measured: below zero, the forecast was too low) and the share of requests that met
    each SLO (do splits pay?)."""
    counts = {}
    signed: dict[str, list[float]] = {}  # metric/kind: [sum, count]
    met: dict[str, list[float]] = {}  # slo/kind: [met, count]
    for metric in server.router.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name.startswith("pdserve:router_prediction_relative_error_"):
                labels = sample.labels
                key = f"{labels['metric']}_bias/{labels['kind']}"
                sign = 1.0 if labels["direction"] == "over" else -1.0
                total = signed.setdefault(key, [0.0, 0.0])
                if sample.name.endswith("_sum"):
                    total[0] += sign * sample.value
                elif sample.name.endswith("_count"):
                    total[1] += sample.value
            if sample.name == "pdserve:router_slo_requests_total":
                labels = sample.labels
                total = met.setdefault(f"{labels['slo']}_met/{labels['kind']}", [0.0, 0.0])
                total[0] += sample.value if labels["met"] == "true" else 0.0
                total[1] += sample.value
            if sample.name == "pdserve:router_decisions_total":
                key = sample.labels["kind"] + (f"/{sample.labels['reason']}"
                                               if sample.labels["reason"] else "")
                counts[key] = sample.value
            elif sample.name == "pdserve:router_placement_waits_total":
                counts["waits"] = sample.value
            elif sample.name == "pdserve:router_placement_waiters_total":
                counts[f"waiters_{sample.labels['outcome']}"] = sample.value
            elif sample.name == "pdserve:router_prefix_hit_tokens_total":
                counts[f"prefix_tokens_{sample.labels['where']}"] = sample.value
    for key, (total, n) in [*signed.items(), *met.items()]:
        if n:
            counts[key] = round(total / n, 3)
    return counts


def run_fixed(config, mode, routing, requests, rate, slo, burstiness, seed) -> dict:
    with Cluster(config, mode, routing) as server:
        cfg = driver.RunConfig("grpc", server.grpc_target, request_rate=rate,
                               burstiness=burstiness, seed=seed, progress=False,
                               slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms)
        records, duration = asyncio.run(driver.run(requests, cfg))
        return {**summarize(records, duration, slo, num_workers=2),
                "decisions": decisions(server)}




def errors(rows: list[dict]) -> dict:
    out = {}
    for metric in ("ttft", "tpot"):
        p50 = [r["prediction_error"][metric]["p50"] for r in rows]
        p90 = [r["prediction_error"][metric]["p90"] for r in rows]
        out[metric] = {"p50": spread(p50), "p90": spread(p90)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sections", nargs="+", default=["adaptive", "policies", "prefix",
                                                      "overload"])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="adaptive section: the arms run")
    ap.add_argument("--workloads", nargs="+", default=["azure-conv", "azure-code", "mix"])
    ap.add_argument("--burstiness", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 6.0],
                    help="the request rates each sweep runs at")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--input-len", type=int, default=368, help="prefix-shared: suffix length")
    ap.add_argument("--output-len", type=int, default=32, help="prefix-shared: output length")
    ap.add_argument("--prefix-share", type=float, default=0.9)
    ap.add_argument("--prefix-workload", default="conversations",
                    choices=["conversations", "prefix-shared"],
                    help="the prefix section's workload (conversations: multi-turn, about "
                    "37%% of prompt blocks seen before, as in Mooncake's trace)")
    ap.add_argument("--prefix-rate", type=float, default=None,
                    help="the prefix section's request rate (default: the middle --rates)")
    ap.add_argument("--prefix-kv-mib", type=int, default=256,
                    help="each worker's KV cache (MiB) in the prefix section: a smaller "
                    "one evicts sooner, which makes where a turn runs matter more")
    ap.add_argument("--slo-scale", type=float, default=4.0)
    ap.add_argument("--tpot-slo-scale", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument("--overload-max-wait-ms", type=float, default=40.0,
                    help="overload: the third arm's bound on a wait for capacity")
    ap.add_argument("--overload-rate", type=float, default=None,
                    help="the overload's request rate (default: 3x the adaptive goodput "
                    "this run measured, else 3x the lowest --rates)")
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/routing.json")
    args = ap.parse_args()

    model_dir = resolve_model_path(args.model)
    config = EngineConfig.from_kwargs(str(model_dir), num_threads=args.engine_threads,
                                      kv_cache_memory_bytes=256 << 20)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    results: dict = {"args": vars(args), "sections": {}}
    ratios: list[str] = []
    goodput = RoutingSpec()
    # The prefix arms place every request (admission always): refusals would drop the
    # slowest requests from the TTFT figures of the arm that refuses more.
    aware = RoutingSpec(admission="always")
    unaware = RoutingSpec(admission="always", prefix_aware=False)

    def slo_of(workload):
        isolated = measure_isolated(config, workload(0))
        return slo_for(isolated, args.slo_scale, args.tpot_slo_scale)

    if "adaptive" in args.sections:
        section = results["sections"]["adaptive"] = {}
        for name in args.workloads:
            workload = workload_fn(name, args, vocab)
            slo = slo_of(workload)
            for burst in args.burstiness:
                arms = {mode: [] for mode in args.modes}
                for r in range(args.rounds):
                    for mode in args.modes:
                        result = run_sweep(config, mode, goodput, workload, args.rates, slo,
                                           burst, args.seed + r)
                        arms[mode].append(result)
                        print(f"{name} burst {burst} round {r} {mode}: "
                              f"{result['max_rate_per_worker']}", flush=True)
                best = {m: spread([a["max_rate_per_worker"] for a in runs])
                        for m, runs in arms.items()}
                base = max((best[m]["median"] or 0 for m in ("colocated", "disaggregated")
                            if m in best), default=0)
                mine = best.get("adaptive", {}).get("median")
                ratio = mine / base if base and mine else None
                adaptive_rows = [row for a in arms.get("adaptive", []) for row in a["rows"]]
                section[f"{name}/burst{burst:g}"] = {
                    "slo": vars(slo), "goodput_per_worker": best, "ratio": ratio,
                    "prediction_error": errors(adaptive_rows), "runs": arms}
                ratios.append(f"adaptive / best fixed mode, {name}, burstiness {burst:g}: "
                              f"{ratio if ratio is None else round(ratio, 2)} "
                              f"(per-worker goodput {best})")

    if "policies" in args.sections:
        workload = workload_fn("mix", args, vocab)
        slo = slo_of(workload)
        arms = {p: [] for p in ("goodput", "least-loaded", "round-robin")}
        for r in range(args.rounds):
            for policy in arms:
                arms[policy].append(run_sweep(config, "adaptive",
                                              RoutingSpec(routing_policy=policy), workload,
                                              args.rates, slo, 0.25, args.seed + r))
        best = {p: spread([a["max_rate_per_worker"] for a in runs]) for p, runs in arms.items()}
        g, ll, rr = (best[p]["median"] for p in arms)
        results["sections"]["policies"] = {"slo": vars(slo), "goodput_per_worker": best,
                                           "runs": arms}
        ratios.append(f"goodput / least-loaded / round-robin policy, bursty mix: "
                      f"{g} / {ll} / {rr} req/s per worker"
                      + (f" -> {g / ll:.2f}x over least-loaded" if g and ll else ""))

    if "prefix" in args.sections:
        workload = workload_fn(args.prefix_workload, args, vocab)
        slo = slo_of(workload)
        rate = args.prefix_rate or args.rates[len(args.rates) // 2]
        small = EngineConfig.from_kwargs(str(model_dir), num_threads=args.engine_threads,
                                         kv_cache_memory_bytes=args.prefix_kv_mib << 20)
        arms = {"prefix-aware": [], "not": []}
        shares = []
        for r in range(args.rounds):
            requests = workload(r)
            shares.append(seen_block_share(requests, config.cache.block_size))
            for arm, routing in (("prefix-aware", aware), ("not", unaware)):
                arms[arm].append(run_fixed(small, "colocated", routing, requests, rate,
                                           slo, 1.0, args.seed + r))
                run = arms[arm][-1]
                print(f"  prefix round {r} {arm}: ttft p50 {run['ttft_ms']['p50']:.1f} ms, "
                      f"p90 {run['ttft_ms']['p90']:.1f} ms, prompt tokens cached "
                      f"{run['prefix_hit_share']:.0%}, SLO attainment "
                      f"{run['slo_attainment']:.2f}, decisions {run['decisions']}", flush=True)
        ttft = {arm: spread([s["ttft_ms"]["p50"] for s in runs]) for arm, runs in arms.items()}
        hits = {arm: spread([s["prefix_hit_share"] for s in runs]) for arm, runs in arms.items()}
        per_round = spread([n["ttft_ms"]["p50"] / a["ttft_ms"]["p50"]
                            for a, n in zip(arms["prefix-aware"], arms["not"])])
        results["sections"]["prefix"] = {
            "workload": args.prefix_workload, "rate": rate, "kv_mib": args.prefix_kv_mib,
            "slo": vars(slo),
            "seen_block_share": spread(shares), "prefix_hit_share": hits, "ttft_p50_ms": ttft,
            "ratio_per_round": per_round, "runs": arms}
        a, n = ttft["prefix-aware"]["median"], ttft["not"]["median"]
        ratios.append(f"{args.prefix_workload} ({statistics.median(shares):.0%} of prompt blocks "
                      f"seen before) at {rate:g} req/s, TTFT p50 not / prefix-aware: "
                      f"{n:.1f} / {a:.1f} ms = {n / a:.2f}x (per round "
                      f"{per_round['median']:.2f} [{per_round['min']:.2f}, "
                      f"{per_round['max']:.2f}]); prompt tokens cached "
                      f"{hits['prefix-aware']['median']:.0%} vs {hits['not']['median']:.0%}")

    if "overload" in args.sections:
        workload = workload_fn("azure-conv", args, vocab)
        slo = slo_of(workload)
        found = results["sections"].get("adaptive", {}).get(f"azure-conv/burst{args.burstiness[0]:g}")
        base_rate = ((found or {}).get("goodput_per_worker", {}).get("adaptive", {}).get("median")
                     or args.rates[0] / 2) * 2
        rate = args.overload_rate or 3 * base_rate
        n = max(args.num_prompts, int(rate * args.overload_s))
        capped = f"slo, max wait {args.overload_max_wait_ms:g} ms"
        specs = {"slo": goodput, capped: replace(goodput, max_wait_ms=args.overload_max_wait_ms),
                 "always": replace(goodput, admission="always")}
        arms = {arm: [] for arm in specs}
        for r in range(args.rounds):
            requests = make_workload("azure-conv", n, vocab, args.seed + 50 + r, args.scale)
            for arm, routing in specs.items():
                arms[arm].append(run_fixed(config, "adaptive", routing, requests, rate, slo,
                                           1.0, args.seed + r))
                run = arms[arm][-1]
                print(f"  overload round {r} {arm}: goodput {run['goodput']:.2f} req/s, "
                      f"rejected {run['rejected']}, rejection ms {run['rejection_ms']}, "
                      f"decisions {run['decisions']}", flush=True)
        good = {a: spread([s["goodput"] for s in runs]) for a, runs in arms.items()}
        reject = {a: {p: spread([s["rejection_ms"][p] for s in arms[a]]) for p in ("p50", "p99")}
                  for a in ("slo", capped)}
        results["sections"]["overload"] = {"rate": rate, "goodput": good,
                                           "rejection_ms": reject, "runs": arms}
        w = good["always"]["median"]
        for arm in ("slo", capped):
            s = good[arm]["median"]
            ratios.append(f"3x overload ({rate:.2f} req/s): goodput admission {arm} / always: "
                          f"{s:.2f} / {w:.2f} = {s / w if w else float('inf'):.2f}x; "
                          f"rejections answered in p50 {reject[arm]['p50']['median']} ms, p99 "
                          f"{reject[arm]['p99']['median']} ms (waits for capacity included)")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_json(args.out, results)
    print(f"wrote {args.out}")
    for line in ratios:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
