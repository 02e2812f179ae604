"""`pdserve bench run` (load-test a running server) and `pdserve bench compare`
(disaggregated vs colocated, launched here). Each subcommand owns its flags; the
workload and SLO flags they share are declared once below."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from pdserve import env
from pdserve.bench.driver import BACKENDS
from pdserve.bench.sessions import MAX_TURNS, SessionShape
from pdserve.bench.workloads import WORKLOADS


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="load-test a server and report goodput",
                           description="Goodput load tests: `run` drives a running server, "
                           "`compare` launches disaggregated and colocated clusters and "
                           "compares their goodput per worker.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    run = kinds.add_parser("run", help="drive a running server (pdserve gRPC or any "
                           "OpenAI-compatible HTTP server) and report goodput")
    run.add_argument("--backend", choices=BACKENDS, default="grpc",
                     help="grpc: pdserve's API; openai: /v1/completions, streaming "
                     "(default: %(default)s)")
    run.add_argument("--target", required=True,
                     help="host:port (grpc) or base URL http://host:port (openai)")
    run.add_argument("--model", default=None, help="the model name an OpenAI server expects")
    run.add_argument("--api-key", default=env.api_key(),
                     help="sent as Authorization: Bearer (default: $PDSERVE_API_KEY)")
    run.add_argument("--ca-file", default=None,
                     help="TLS: PEM roots that verify the server (gRPC over TLS; for "
                     "openai, an https --target)")
    run.add_argument("--vocab-size", type=int, default=None,
                     help="token ids of random prompts stay below this (grpc: asked of the "
                     "server; openai: default 1000)")
    run.add_argument("--num-workers", type=int, default=1,
                     help="goodput is divided by this: requests per second per worker "
                     "(default: %(default)s)")
    run.add_argument("--max-model-len", type=int, default=None,
                     help="sessions: the context a turn's prompt and reply must fit; a "
                     "session ends before a turn that would not (grpc: asked of the "
                     "server; openai: unset means 32768 x --scale)")
    add_load_flags(run)
    add_workload_flags(run, default_name="bench", sessions=True)
    run.set_defaults(func=_run)

    compare = kinds.add_parser("compare", help="disaggregated vs colocated goodput per "
                               "worker, same model, workload and SLOs, in one run")
    compare.add_argument("--model", default="tiny",
                         help="the model to serve: a local HF directory or tiny "
                         "(default: %(default)s)")
    compare.add_argument("--prefill-workers", type=int, default=1,
                         help="P: disaggregated runs P prefill + D decode workers, "
                         "colocated P + D engine workers (default: %(default)s)")
    compare.add_argument("--decode-workers", type=int, default=1,
                         help="D (default: %(default)s)")
    compare.add_argument("--sweep", type=float, nargs="+", required=True, metavar="RATE",
                         help="the request rates each mode runs at")
    compare.add_argument("--slo-scale", type=float, default=None,
                         help="SLOs = k x the isolated prefill (TTFT) and decode step (TPOT); "
                         "overrides --goodput")
    compare.add_argument("--tpot-slo-scale", type=float, default=None,
                         help="a separate k for TPOT (a TPOT-tight SLO)")
    compare.add_argument("--engine-threads", type=int, default=1,
                         help="torch threads per worker (default: %(default)s)")
    compare.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20,
                         help="KV cache per worker (default: %(default)s)")
    add_workload_flags(compare, default_name="compare")
    compare.set_defaults(func=_compare)


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """How requests are sent: a rate (or a sweep of rates) and a cap in flight."""
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second; inf sends all at once "
                   "(default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=0,
                   help="the most requests in flight; 0 = no cap (default: %(default)s)")
    p.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RATE",
                   help="run at each request rate instead; report the highest rate per "
                   "worker with >= 90%% SLO attainment")


def add_workload_flags(p: argparse.ArgumentParser, default_name: str,
                       sessions: bool = False) -> None:
    """sessions: whether --workload sessions (turns sent as earlier ones end) is one."""
    load = p.add_argument_group("workload")
    load.add_argument("--workload", default="random",
                      choices=WORKLOADS if sessions else [w for w in WORKLOADS
                                                          if w != "sessions"],
                      help="prompt and output lengths (default: %(default)s)")
    load.add_argument("--dataset-path", default=None,
                      help="JSONL of {prompt | prompt_token_ids, max_tokens, timestamp?} "
                      "for --workload file")
    load.add_argument("--num-prompts", type=int, default=100,
                      help="requests per run (sessions: sessions per run) "
                      "(default: %(default)s)")
    load.add_argument("--scale", type=float, default=1.0,
                      help="shrink every length to fit a small model's context "
                      "(default: %(default)s)")
    load.add_argument("--input-len", type=int, default=1024,
                      help="random: mean prompt length (default: %(default)s)")
    load.add_argument("--output-len", type=int, default=128,
                      help="random: mean output length (default: %(default)s)")
    load.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in len x [1 - r, 1 + r] "
                      "(default: %(default)s)")
    load.add_argument("--prefix-share", type=float, default=0.5,
                      help="prefix-shared: share of prompts that start with a common prefix "
                      "(default: %(default)s)")
    if sessions:
        load.add_argument("--session-turns", type=float, default=SessionShape.mean_turns,
                          help="sessions: mean turns per session, 1 + geometric, at most "
                          f"{MAX_TURNS} (default: %(default)s)")
        load.add_argument("--think-time", type=float, default=SessionShape.think_s,
                          help="sessions: mean seconds from a turn's end to the next "
                          "turn's send, exponential (default: %(default)s)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma arrivals' shape: 1 = Poisson, < 1 burstier "
                      "(default: %(default)s)")
    load.add_argument("--seed", type=int, default=0, help="workload and arrival seed "
                      "(default: %(default)s)")
    out = p.add_argument_group("SLOs and output")
    out.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                     help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    out.add_argument("--out-dir", default="bench-results",
                     help="where JSON, Markdown and PNG go (default: %(default)s)")
    out.add_argument("--name", default=default_name,
                     help="file name stem of the outputs (default: %(default)s)")
    out.add_argument("--quiet", action="store_true",
                     help="no progress bar (there is none when stderr is not a terminal)")


def workload_of(args: argparse.Namespace, vocab: int, lazy: bool = False,
                max_model_len: int | None = None):
    """Run i's prompts (or sessions), drawn with seed + 1 + i (a sweep's warm-up is
    i = -1): a list, or (lazy) an iterator that draws each when it is asked for.
    max_model_len: the model's context, which sessions' turns must fit."""
    from pdserve.bench.workloads import iter_workload, make_workload

    shape = None
    if args.workload == "sessions":
        try:
            shape = SessionShape(args.session_turns, args.think_time, max_model_len)
        except ValueError as err:
            raise SystemExit(f"pdserve: {err}") from None

    def workload(i: int):
        return (iter_workload if lazy else make_workload)(
            args.workload, args.num_prompts, vocab, args.seed + 1 + i, args.scale,
            args.input_len, args.output_len, args.range_ratio, args.prefix_share,
            path=args.dataset_path, sessions=shape)
    return workload


def _run(args: argparse.Namespace) -> int:
    from pdserve.bench import driver
    from pdserve.bench.metrics import SLO, summarize
    from pdserve.bench.sweep import sweep

    slo = SLO.parse(args.goodput)
    vocab, context = args.vocab_size, args.max_model_len
    if args.backend == "grpc" and (vocab is None or (
            context is None and args.workload == "sessions")):
        from pdserve.client import Client
        with Client(args.target, api_key=args.api_key, ca_file=args.ca_file) as client:
            info = client.model_info()
        vocab, context = vocab or info.vocab_size, context or info.max_model_len or None
    vocab = vocab or 1000
    cfg = driver.RunConfig(args.backend, args.target, args.model, args.request_rate,
                           args.burstiness, args.max_concurrency, args.seed,
                           api_key=args.api_key, ca_file=args.ca_file,
                           slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms,
                           progress=not args.quiet)
    meta = run_meta(args, backend=args.backend, target=args.target)
    if args.sweep:
        result = asyncio.run(sweep(workload_of(args, vocab, max_model_len=context), cfg,
                                   args.sweep, slo, args.num_workers))
    else:
        records, duration = asyncio.run(driver.run(
            workload_of(args, vocab, max_model_len=context)(-1), cfg))
        result = summarize(records, duration, slo, args.num_workers)
    publish(args, result, meta)
    return 0


def run_meta(args: argparse.Namespace, **fields) -> dict:
    """What a report says of its run: the workload, arrivals and SLOs, and `fields`."""
    meta = {**fields, **{k: getattr(args, k) for k in (
        "workload", "num_prompts", "scale", "request_rate", "burstiness", "max_concurrency",
        "goodput", "seed", "num_workers")}}
    meta["request_rate"] = str(meta["request_rate"])
    if args.workload == "sessions":
        meta.update(session_turns=args.session_turns, think_time=args.think_time)
    return meta


def publish(args: argparse.Namespace, result: dict, meta: dict) -> None:
    """Prints a run's (or a sweep's) report and writes its JSON and Markdown (and a
    sweep's PNG) under --out-dir, named --name."""
    from pdserve.bench import report

    slo_text = "" if not args.goodput else f" [{' '.join(args.goodput)}]"
    if "rows" in result:
        for row in result["rows"]:
            print(f"rate {row['rate']:g} req/s")
            print(report.text_block(row, slo_text))
        print(report.sweep_markdown(result))
        paths = report.write_sweep(args.out_dir, args.name, result, meta)
    else:
        print(report.text_block(result, slo_text))
        paths = report.write(args.out_dir, args.name, result, meta)
    for path in paths:
        print(f"wrote {path}")


def _compare(args: argparse.Namespace) -> int:
    from pdserve.bench import compare, report
    from pdserve.bench.metrics import SLO
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.model_path import resolve_model_path

    model_dir = resolve_model_path(args.model)
    config = EngineConfig.from_kwargs(str(model_dir), num_threads=args.engine_threads,
                                      kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    workload = workload_of(args, ModelConfig.from_dir(model_dir).vocab_size)
    isolated = compare.measure_isolated(config, workload(0))
    if args.slo_scale is not None:
        slo = compare.slo_for(isolated, args.slo_scale, args.tpot_slo_scale or args.slo_scale)
    else:
        slo = SLO.parse(args.goodput)
    print(f"isolated: prefill of the median prompt {isolated.prefill_s * 1e3:.1f} ms, "
          f"decode step {isolated.decode_step_s * 1e3:.2f} ms -> SLO ttft "
          f"{slo.ttft_ms} ms, tpot {slo.tpot_ms} ms", flush=True)
    results = {}
    for mode in ("disaggregated", "colocated"):
        results[mode] = compare.run_mode(mode, config, args.prefill_workers,
                                         args.decode_workers, workload, args.sweep, slo,
                                         args.burstiness, args.seed)
        print(f"--- {mode} ({results[mode]['workers']} workers)")
        print(report.sweep_markdown(results[mode]), flush=True)
    headline = compare.ratio(results["disaggregated"], results["colocated"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for mode, result in results.items():
        report.plot_sweep(result, out / f"{args.name}-{mode}.png")
    (out / f"{args.name}.json").write_text(json.dumps({
        "model": args.model, "workload": args.workload, "scale": args.scale,
        "num_prompts": args.num_prompts, "rates": args.sweep,
        "prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
        "isolated_prefill_ms": isolated.prefill_s * 1e3,
        "isolated_decode_step_ms": isolated.decode_step_s * 1e3,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms},
        "results": results, "goodput_ratio": headline}, indent=2))
    (out / f"{args.name}.md").write_text("\n".join(
        f"## {mode}\n\n{report.sweep_markdown(r)}" for mode, r in results.items())
        + f"\ngoodput per worker, disaggregated / colocated: {headline}\n")
    shown = "n/a (a mode never reached 90% attainment)" if headline is None else f"{headline:.2f}"
    print(f"goodput per worker at >= 90% SLO attainment, disaggregated / colocated: {shown}")
    return 0
