"""`pdserve sim`: a whole cluster in virtual time. It takes `pdserve serve`'s pool,
routing and engine flags (same names, same meanings) and `pdserve bench run`'s
workload, arrival and SLO flags, and writes the same report; `--profile` says how
long things take (a file from `pdserve profile`, or `analytic:<accelerator>` for the
--model's config). `pdserve sim plan` searches pool shapes for a device budget."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdserve import cli_flags
from pdserve.bench.cli import add_load_flags, add_workload_flags, publish, run_meta, workload_of
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_PROFILE = "analytic:h100"


def add_sim_parser(sub) -> None:
    sim = sub.add_parser(
        "sim", help="simulate a cluster in virtual time and report goodput",
        description="Simulate a cluster in virtual time: the production scheduler, block "
        "manager, router, policy and latency model over simulated workers whose steps "
        "and KV transfers take what a profile says. Reports what `pdserve bench run` "
        "reports.")
    add_cluster_flags(sim)
    add_load_flags(sim)
    add_workload_flags(sim, default_name="sim", sessions=True)
    sim.set_defaults(func=_sim)
    kinds = sim.add_subparsers(dest="sim_command", metavar="{plan}")
    plan = kinds.add_parser(
        "plan", help="the pool shape with the most goodput per device for a budget",
        description="For a profile, a workload, SLOs and a device budget: every P:D split, "
        "colocated and adaptive (for each pool's --tensor-parallel-sizes), each searched "
        "(rate doubled, then bisected; a shape next to one searched starts from its "
        "rate) for the highest request rate with >= 90% "
        "SLO attainment. Each shape's row as it ends, then the table, best first.")
    plan.add_argument("--budget", type=int, default=16,
                      help="devices (workers, at a tensor_parallel_size of 1) "
                      "(default: %(default)s)")
    plan.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=None,
                      metavar="N", help="the tensor_parallel_size of each pool searched among "
                      "these, prefill and decode apart (analytic profiles; sizes the model "
                      "does not fit are left out) (default: --tensor-parallel-size)")
    plan.add_argument("--first-rate", type=float, default=1.0,
                      help="the first request rate of a shape searched with no neighbour's "
                      "rate to start from, req/s (default: %(default)s)")
    plan.add_argument("--iterations", type=int, default=4,
                      help="each shape's rate is found to within 2^-N of itself: N "
                      "bisections of a doubling's bracket (default: %(default)s, about "
                      "6%%: finer than an analytic profile is right; each one more "
                      "doubles the probes' length and adds a probe)")
    plan.add_argument("--min-duration", type=float, default=None,
                      help="each probe sends requests for at least this many seconds at "
                      "its rate; --num-prompts is the fewest. Unset: long enough for a "
                      "rate 2^-N above what the shape sustains to fail (its queue grows "
                      "2^-N s a second, so the TTFT SLO over 2^-N x the attainment "
                      "target), at least 5 s")
    plan.add_argument("--jobs", type=int, default=None,
                      help="shapes searched at once, each in a process of its own "
                      "(default: the machine's cores); the table does not depend on it")
    add_cluster_flags(plan, pools=False)
    add_workload_flags(plan, default_name="plan")
    plan.set_defaults(func=_plan, burstiness=1.0)


def add_cluster_flags(p: argparse.ArgumentParser, pools: bool = True) -> None:
    """What `pdserve serve` launches (its flags), and the profile of its workers."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="with an analytic profile: a model config by name "
                   "(llama-3-8b, qwen2-7b) or a local HF directory (its config.json); with "
                   "a profile file, only the name reports carry (default: %(default)s)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="how long steps and transfers take: a JSON file from `pdserve "
                   "profile`, or analytic:<h100|h200|a100|l40s> (a model of the "
                   "accelerator, not a measurement) (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="devices per worker: with an analytic profile, the model split that "
                   "many ways with its collectives over the node's link; a profile file "
                   "carries its own (unset: 1, or the file's)")
    if pools:
        cli_flags.add_flags(p.add_argument_group("pools"), PoolSpec)
    cli_flags.add_flags(p.add_argument_group("routing"), RoutingSpec)
    cli_flags.add_flags(p.add_argument_group("router timeouts and limits"), RouterConfig,
                        only=RouterConfig.flags())
    engine = p.add_argument_group("engine: the scheduler and the KV cache (vLLM's names; "
                                  "--num-kv-blocks overrides the profile's)")
    for cls in (SchedulerConfig, CacheConfig):
        cli_flags.add_flags(engine, cls)


def profile_of(args: argparse.Namespace, tensor_parallel_size: int | None = None):
    """The profile --profile names, sized by the engine flags, for workers of
    tensor_parallel_size devices (default: --tensor-parallel-size)."""
    from pdserve.sim.analytic import NAMED_CONFIGS, analytic_profile
    from pdserve.sim.profile import Profile

    spec, block_size = args.profile, args.block_size
    size = tensor_parallel_size or args.tensor_parallel_size
    if spec.startswith("analytic:"):
        config = NAMED_CONFIGS.get(args.model)
        if config is None:
            path = Path(args.model) / "config.json"
            if not path.is_file():
                raise SystemExit(f"pdserve sim: --model {args.model!r} is neither a named "
                                 f"config ({', '.join(NAMED_CONFIGS)}) nor a directory with "
                                 "a config.json")
            import json
            config = json.loads(path.read_text())
        try:
            profile = analytic_profile(args.model, config, spec.split(":", 1)[1], block_size,
                                       tensor_parallel_size=1 if size is None else size)
        except ValueError as err:
            raise SystemExit(f"pdserve sim: {err}") from None
    else:
        try:
            profile = Profile.load(spec)
        except (OSError, ValueError) as err:
            raise SystemExit(f"pdserve sim: --profile: {err}") from None
        if profile.block_size != block_size:
            raise SystemExit(f"pdserve sim: the profile's blocks hold {profile.block_size} "
                             f"tokens, --block-size says {block_size}")
        if size is not None and size != profile.tensor_parallel_size:
            raise SystemExit(f"pdserve sim: the profile's workers have tensor_parallel_size "
                             f"{profile.tensor_parallel_size}, not {size}: measure one "
                             f"with `pdserve profile --tensor-parallel-size {size}`")
    if args.num_kv_blocks:
        profile = replace(profile, num_kv_blocks=args.num_kv_blocks)
    return profile


def setup_of(args: argparse.Namespace, pools: PoolSpec | None = None, profile=None):
    """The simulated cluster the flags describe (`profile`: in place of --profile's)."""
    from pdserve.sim.run import Setup

    try:
        return Setup(profile=profile or profile_of(args),
                     pools=pools or PoolSpec(**cli_flags.values(args, PoolSpec)),
                     router=RouterConfig(
                         routing=RoutingSpec(**cli_flags.values(args, RoutingSpec)),
                         **cli_flags.values(args, RouterConfig, only=RouterConfig.flags())),
                     scheduler=SchedulerConfig(**cli_flags.values(args, SchedulerConfig)),
                     prefix_caching=args.enable_prefix_caching, seed=args.seed,
                     swap_space=args.swap_space, kv_offloading_size=args.kv_offloading_size)
    except ValueError as err:
        raise SystemExit(f"pdserve sim: {err}") from None


def load_of(args: argparse.Namespace):
    from pdserve.bench.metrics import SLO
    from pdserve.sim.driver import Load

    try:
        slo = SLO.parse(args.goodput)
    except ValueError as err:
        raise SystemExit(f"pdserve sim: {err}") from None
    return Load(request_rate=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, seed=args.seed, slo=slo)


def _sim(args: argparse.Namespace) -> int:
    from pdserve.progress import bar
    from pdserve.sim.run import simulate, sweep

    setup, load = setup_of(args), load_of(args)
    args.num_workers = setup.num_workers
    workload = workload_of(args, setup.profile.vocab_size, lazy=True,
                           max_model_len=setup.profile.max_model_len)
    began = time.perf_counter()
    runs = len(args.sweep) if args.sweep else 1
    total = None if args.workload == "sessions" else args.num_prompts * runs  # turns: drawn
    with bar(total, "simulated requests", "req", args.quiet) as ended:
        def on_end(_record) -> None:
            ended.update(1)
        if args.sweep:
            result = sweep(setup, workload, args.sweep, load, on_end)
            simulated = sum(row["duration_s"] for row in result["rows"])
        else:
            result = simulate(setup, workload(-1), load, on_end)
            simulated = result["duration_s"]
    wall = time.perf_counter() - began
    publish(args, result, run_meta(args, backend="sim", target=setup.profile.name,
                                   mode=setup.pools.mode, roles=setup.pools.roles,
                                   routing_policy=args.routing_policy,
                                   admission=args.admission))
    print(f"simulated {simulated:.1f} s in {wall:.1f} s of wall time: "
          f"{simulated / max(wall, 1e-9):.1f} simulated seconds per wall second")
    return 0


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _plan(args: argparse.Namespace) -> int:
    import functools
    import os

    from pdserve.sim.plan import Draws, Search, min_duration_s

    if not args.goodput:
        raise SystemExit("pdserve sim plan: give the SLOs (--goodput ttft:MS tpot:MS)")
    if args.jobs is not None and args.jobs < 1:
        raise SystemExit("pdserve sim plan: --jobs must be >= 1")
    profiles = _plan_profiles(args)
    from pdserve.sim.plan import shapes
    try:
        shapes(args.budget, tuple(n for n, _ in profiles))
    except ValueError as err:
        raise SystemExit(f"pdserve sim plan: --budget: {err}") from None
    setup = setup_of(args, PoolSpec(prefill_workers=args.budget, decode_workers=0,
                                    mode="colocated"), profile=profiles[0][1])
    args.request_rate, args.max_concurrency = float("inf"), 0
    load = load_of(args)
    if args.min_duration is None:
        args.min_duration = min_duration_s(load.slo, args.iterations)
    vocab = setup.profile.vocab_size
    workload = (Draws(functools.partial(_plan_workload, args, vocab))
                if args.workload != "file" else  # a trace: all of it, at its times
                functools.partial(_plan_trace, args, vocab))
    search = Search(setup=setup, workload=workload, load=load, first_rate=args.first_rate,
                    iterations=args.iterations, min_requests=args.num_prompts,
                    min_duration_s=args.min_duration,
                    profiles=tuple(profiles))
    jobs = args.jobs or os.cpu_count() or 1
    sizes = "" if len(profiles) == 1 else \
        f" of tensor_parallel_size {', '.join(str(n) for n, _ in profiles)}"
    print(f"{setup.profile.name}, {args.budget} devices{sizes}, {args.workload} (each probe at "
          f"least {args.min_duration:.3g} s and {args.num_prompts} requests; rates within "
          f"2^-{args.iterations}), SLOs "
          f"{' '.join(args.goodput)}, routing {args.routing_policy}/{args.admission}; "
          f"{jobs} at once", flush=True)
    began = time.perf_counter()
    found = _search_shapes(args, search, jobs)
    elapsed = time.perf_counter() - began
    print(f"best: {found[0].name}, {found[0].goodput_per_device:.3f} req/s per device; "
          f"{len(found)} shapes, {sum(len(s.probes) for s in found)} probes in "
          f"{elapsed:.0f} s")
    print(f"wrote {Path(args.out_dir) / (args.name + '.md')}, "
          f"{Path(args.out_dir) / (args.name + '.json')}")
    return 0


def _plan_profiles(args: argparse.Namespace) -> list:
    """(tensor_parallel_size, profile) for each size the plan searches: the sizes asked
    for that the model fits (an analytic profile), or the profile file's own."""
    sizes = args.tensor_parallel_sizes
    if not sizes or not args.profile.startswith("analytic:"):
        profile = profile_of(args)
    if not sizes:
        return [(profile.tensor_parallel_size, profile)]
    if not args.profile.startswith("analytic:") and set(sizes) != {
            profile.tensor_parallel_size}:
        raise SystemExit("pdserve sim plan: --tensor-parallel-sizes needs an analytic "
                         f"profile; {args.profile} is measured at tensor_parallel_size "
                         f"{profile.tensor_parallel_size}")
    found = []
    for n in sorted(set(sizes)):
        try:
            found.append((n, profile_of(args, n)))
        except SystemExit as why:
            print(f"tensor_parallel_size {n} left out: {why}", flush=True)
    if not found:
        raise SystemExit("pdserve sim plan: the model fits none of --tensor-parallel-sizes")
    return found


def _plan_trace(args: argparse.Namespace, vocab: int, n: int):
    return workload_of(args, vocab)(0)


def _plan_workload(args: argparse.Namespace, vocab: int):
    """The plan's seeded workload, drawn as it is read (as many as are read)."""
    return iter(workload_of(replace_args(args, num_prompts=sys.maxsize), vocab,
                            lazy=True)(0))


def _search_shapes(args: argparse.Namespace, search, jobs: int) -> list:
    """Every shape searched: a bar of shapes with the time left, a line per probe (both
    on a terminal), and each shape's row as it ends; the table, best first, rewritten
    under --out-dir after every shape, so a stopped run keeps what it found."""
    from pdserve.progress import bar
    from pdserve.sim.plan import (
        best_first,
        plan,
        shapes,
        table,
        table_header,
        table_row,
    )

    found: list = []
    with bar(len(shapes(args.budget, search.tp_sizes)), "shapes", "shape",
             args.quiet) as progress:
        def on_probe(shape, p) -> None:
            verdict = "holds" if p.holds else "fails"
            share = (f"attainment {p.attainment:.3f}" if p.attainment is not None else
                     f"certain after {p.ended}/{p.requests} requests")
            line = (f"  {shape.name}: {p.rate:.2f} req/s {verdict} ({share}; "
                    f"{p.wall_s:.1f} s)")
            progress.set_postfix_str(f"{shape.name} {p.rate:.1f} req/s {verdict}")
            if not progress.disable:
                progress.write(line)

        progress.write(table_header(), end="", file=sys.stdout)
        for searched in plan(search, args.budget, jobs, on_probe):
            found.append(searched)
            _write_plan(args, search, best_first(found), complete=len(found) == progress.total)
            progress.write(table_row(searched), end="", file=sys.stdout)
            progress.update(1)
    text = table(found)
    print(f"\nbest first:\n{text}", end="")
    return best_first(found)


def _write_plan(args: argparse.Namespace, search, found: list, complete: bool) -> None:
    import json

    from pdserve.sim.plan import table

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(table(found))
    (out / f"{args.name}.json").write_text(json.dumps({
        "complete": complete, "profile": search.setup.profile.name, "budget": args.budget,
        "workload": args.workload, "num_prompts": args.num_prompts, "scale": args.scale,
        "seed": args.seed, "goodput": args.goodput, "routing_policy": args.routing_policy,
        "admission": args.admission, "min_duration_s": args.min_duration,
        "iterations": args.iterations, "shapes": [
            {"pools": s.name, "mode": s.pools.mode, "prefill_workers": s.pools.prefill_workers,
             "decode_workers": s.pools.decode_workers, "devices": s.devices,
             "prefill_tensor_parallel_size": s.shape.prefill_tp if s.shape else 1,
             "decode_tensor_parallel_size": s.shape.decode_tp if s.shape else 1,
             "max_rate": s.max_rate, "goodput_per_worker": s.goodput_per_worker,
             "goodput_per_device": s.goodput_per_device,
             "probes": [{"rate": p.rate, "holds": p.holds, "attainment": p.attainment,
                         "ended": p.ended, "requests": p.requests, "wall_s": p.wall_s}
                        for p in s.probes]} for s in found]}, indent=2))
