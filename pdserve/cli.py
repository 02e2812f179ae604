"""The `pdserve` command line: serve, demo, bench, make-tiny-model."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    # Every command that uses Ray calls ray.init itself; a stray call on a handle after
    # shutdown must fail, not quietly start a second local cluster.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the cluster and serve gRPC + HTTP")
    _cluster_args(serve)
    serve.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (default: start a local one)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--grpc-port", type=int, default=50051)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="1 prefill + 1 decode worker on the tiny model, "
                          "a few requests through the SDK and the HTTP API")
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--offline", action="store_true",
                      help="run the offline engine instead of the cluster")
    demo.add_argument("--num-prompts", type=int, default=8)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="load-test a server and report goodput; "
                           "`bench compare` runs disaggregated vs colocated")
    bench.add_argument("what", nargs="?", choices=["run", "compare"], default="run")
    bench.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    bench.add_argument("--target", default=None,
                       help="host:port (grpc) or base URL http://host:port (openai)")
    bench.add_argument("--model", default=None, help="model name for an OpenAI server; "
                       "for compare, the model to serve (a local HF directory or tiny)")
    bench.add_argument("--prefill-workers", type=int, default=1, help="compare: P")
    bench.add_argument("--decode-workers", type=int, default=1, help="compare: D")
    bench.add_argument("--slo-scale", type=float, default=None,
                       help="compare: SLOs = k x isolated prefill (TTFT) and decode step (TPOT)")
    bench.add_argument("--tpot-slo-scale", type=float, default=None,
                       help="compare: a separate k for TPOT (a TPOT-tight SLO)")
    bench.add_argument("--engine-threads", type=int, default=1, help="compare: per worker")
    bench.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    bench.add_argument("--workload", default="random",
                       help="random | sharegpt-like | azure-conv | azure-code | "
                       "prefix-shared | file")
    bench.add_argument("--dataset-path", default=None, help="JSONL for --workload file")
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--scale", type=float, default=1.0,
                       help="shrink every length (fit a small model's context)")
    bench.add_argument("--input-len", type=int, default=1024)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--range-ratio", type=float, default=0.0)
    bench.add_argument("--prefix-share", type=float, default=0.5)
    bench.add_argument("--vocab-size", type=int, default=None,
                       help="for random prompts on non-pdserve servers (grpc asks the server)")
    bench.add_argument("--request-rate", type=float, default=float("inf"))
    bench.add_argument("--burstiness", type=float, default=1.0)
    bench.add_argument("--max-concurrency", type=int, default=0)
    bench.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                       help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    bench.add_argument("--num-workers", type=int, default=1,
                       help="divide goodput by this (requests per second per worker)")
    bench.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RATE",
                       help="run at each request rate; report the highest rate per worker "
                       "with >= 90%% SLO attainment")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out-dir", default="bench-results")
    bench.add_argument("--name", default="bench")
    bench.set_defaults(func=_bench)

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight HF model + tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny)

    args = parser.parse_args(argv)
    return args.func(args) or 0


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a local HF directory, or `tiny`")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--num-cpus-per-worker", type=float, default=1.0)
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--transfer-timeout", type=float, default=30.0)


def _launch(args):
    from engine.config import EngineConfig
    from kv_transfer import TransferConfig
    from router.launch import PoolSpec, launch

    config = EngineConfig.from_kwargs(
        args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_threads=args.num_threads)
    pools = PoolSpec(args.prefill_workers, args.decode_workers, args.mode,
                     args.num_cpus_per_worker, args.num_gpus_per_worker)
    return launch(config, pools, TransferConfig(timeout_s=args.transfer_timeout),
                  served_model_name=args.served_model_name or args.model)


def _serve(args) -> int:
    import ray

    from router.server import RouterServer

    ray.init(address=args.ray_address, include_dashboard=False,
             log_to_driver=args.ray_address is None)
    srv = RouterServer(_launch(args), args.host, args.grpc_port, args.http_port)
    print(f"pdserve serving {args.model!r} ({args.mode}): gRPC {srv.grpc_target}  "
          f"HTTP {srv.http_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(f"draining (up to {args.drain_timeout:g}s) ...", flush=True)
    srv.stop(args.drain_timeout)
    ray.shutdown()
    print("stopped", flush=True)
    return 0


def _demo(args) -> int:
    if args.offline:
        return _offline_demo(args)
    import httpx
    import ray

    from pdserve.client import Client
    from router.server import RouterServer

    t0 = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        demo_args = argparse.Namespace(
            model=args.model, served_model_name=None, mode="disaggregated", prefill_workers=1,
            decode_workers=1, num_cpus_per_worker=1.0, num_gpus_per_worker=0.0, device="cpu",
            dtype=None, max_model_len=None, max_num_seqs=64, max_num_batched_tokens=2048,
            long_prefill_token_threshold=256, no_prefix_caching=False,
            kv_cache_memory_bytes=256 << 20, num_threads=1, transfer_timeout=30.0)
        srv = RouterServer(_launch(demo_args))
        print(f"cluster up in {time.perf_counter() - t0:.1f}s: 1 prefill + 1 decode worker, "
              f"gRPC {srv.grpc_target}, HTTP {srv.http_url}")
        prompts = [f"{_TOPICS[i % len(_TOPICS)]} {i}" for i in range(args.num_prompts)]
        with Client(srv.grpc_target) as client:
            for prompt in prompts[:3]:
                out = client.generate(prompt, max_tokens=args.max_tokens, temperature=0,
                                      ignore_eos=True)
                print(f"[gRPC] {prompt!r} -> {out.text[:60]!r}  ttft {out.ttft_s * 1e3:.0f} ms"
                      f"  e2e {out.e2e_s * 1e3:.0f} ms  ({out.usage.completion_tokens} tokens)")
            t1 = time.perf_counter()
            outs = _concurrently(client, prompts, args.max_tokens)
            elapsed = time.perf_counter() - t1
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"[gRPC] {len(outs)} concurrent requests: {tokens} tokens in {elapsed:.2f}s "
              f"({tokens / elapsed:.0f} tok/s), median ttft "
              f"{sorted(o.ttft_s for o in outs)[len(outs) // 2] * 1e3:.0f} ms")
        r = httpx.post(f"{srv.http_url}/v1/completions", timeout=60, json={
            "model": args.model, "prompt": prompts[0], "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True})
        body = r.json()
        print(f"[HTTP] /v1/completions {r.status_code}: {body['choices'][0]['text'][:60]!r} "
              f"usage {body['usage']['completion_tokens']} tokens")
        srv.stop()
    finally:
        ray.shutdown()
    print(f"demo done in {time.perf_counter() - t0:.1f}s")
    return 0


_TOPICS = ["The history of", "A recipe for", "def fibonacci(n):", "Dear reader,",
           "import numpy as np\n", "In the beginning", "The weather today", "Once upon a time"]


def _concurrently(client, prompts, max_tokens):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True), prompts))


def _offline_demo(args) -> int:
    from pdserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory_bytes=512 << 20)
    print(f"loaded {args.model!r} in {time.perf_counter() - t0:.1f}s "
          f"({llm.engine.model_config.num_layers} layers, "
          f"{llm.engine.block_manager.num_blocks} KV blocks)")
    prompts = [f"{_TOPICS[i % len(_TOPICS)]} {i}" for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for out in outputs[:4]:
        prompt = llm.tokenizer.decode(out.prompt_token_ids)
        print(f"--- {prompt!r} -> {out.text[:80]!r}  "
              f"(ttft {out.metrics.ttft * 1e3:.0f} ms, e2e {out.metrics.e2e * 1e3:.0f} ms)")
    generated = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} output tokens "
          f"in {elapsed:.2f}s: {generated / elapsed:.0f} output tok/s")
    return 0


def _bench(args) -> int:
    if args.what == "compare":
        return _bench_compare(args)
    import asyncio

    from benchmarks.harness import driver, report
    from benchmarks.harness.metrics import SLO, summarize
    from benchmarks.harness.workloads import make_workload

    if not args.target:
        raise SystemExit("pdserve bench: --target is required (or use `bench compare`)")
    slo = SLO.parse(args.goodput)
    vocab = args.vocab_size
    if vocab is None:
        if args.backend == "grpc":
            from pdserve.client import Client
            with Client(args.target) as client:
                vocab = client.model_info().vocab_size
        else:
            vocab = 1000
    cfg = driver.RunConfig(args.backend, args.target, args.model, args.request_rate,
                           args.burstiness, args.max_concurrency, args.seed)
    slo_text = "" if not args.goodput else f" [{' '.join(args.goodput)}]"
    meta = {k: getattr(args, k) for k in ("backend", "target", "workload", "num_prompts",
                                          "scale", "request_rate", "burstiness",
                                          "max_concurrency", "goodput", "seed", "num_workers")}
    meta["request_rate"] = str(meta["request_rate"])
    if args.sweep:
        from benchmarks.harness.sweep import sweep
        result = asyncio.run(sweep(_workload_per_run(args, vocab), cfg, args.sweep, slo,
                                   args.num_workers))
        for row in result["rows"]:
            print(f"rate {row['rate']:g} req/s")
            print(report.text_block(row, slo_text))
        print(report.sweep_markdown(result))
        paths = report.write_sweep(args.out_dir, args.name, result, meta)
    else:
        requests = make_workload(args.workload, args.num_prompts, vocab, args.seed, args.scale,
                                 args.input_len, args.output_len, args.range_ratio,
                                 args.prefix_share, path=args.dataset_path)
        records, duration = asyncio.run(driver.run(requests, cfg))
        summary = summarize(records, duration, slo, args.num_workers)
        print(report.text_block(summary, slo_text))
        paths = report.write(args.out_dir, args.name, summary, meta)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _workload_per_run(args, vocab: int):
    """Run i of a sweep draws its prompts with seed + 1 + i (i = -1 is the warm-up)."""
    from benchmarks.harness.workloads import make_workload

    def workload(i: int):
        return make_workload(args.workload, args.num_prompts, vocab, args.seed + 1 + i,
                             args.scale, args.input_len, args.output_len, args.range_ratio,
                             args.prefix_share, path=args.dataset_path)
    return workload


def _bench_compare(args) -> int:
    import json
    from pathlib import Path

    from benchmarks.harness import compare, report
    from benchmarks.harness.metrics import SLO
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.model_path import resolve_model_path

    if not args.sweep:
        raise SystemExit("pdserve bench compare: give the rates with --sweep RATE ...")
    model = args.model or "tiny"
    model_dir = resolve_model_path(model)
    config = EngineConfig.from_kwargs(str(model_dir), num_threads=args.engine_threads,
                                      kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    workload = _workload_per_run(args, vocab)
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
        "model": model, "workload": args.workload, "scale": args.scale,
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


def _make_tiny(args) -> int:
    from dataclasses import replace

    from engine.tiny_model import TINY, make_tiny_model

    path = make_tiny_model(args.dir, replace(TINY, seed=args.seed))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
