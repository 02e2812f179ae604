"""Where an engine step's time goes, on CPU or a GPU: a diagnostic, not a benchmark.

Fills the engine with `--num-requests` requests (seeded prompts in --prompt-range,
greedy, ignore_eos), then profiles two phases with torch.profiler:
- prefill: the first `--steps` steps (prompt chunks, up to max_num_batched_tokens);
- decode: `--steps` steps once every request decodes (the batch all decodes).
For each phase it prints the median step time, the ops with the most self time on the
host and (on a GPU) on the device, the kernels launched per step, the share of the step
the device was busy, and (on a GPU) the host-device synchronizations per step, counted
by torch's sync debug mode. Writes the tables as JSON to --out, and each phase's Chrome
trace to --trace-dir if given.

On an H100 / H200 with cuDNN newer than 9.15, PyTorch tries cuDNN's attention first
(unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1), and cuDNN builds an execution graph for each
new shape; the JSON records that variable, so runs with and without it compare.

  python scripts/profile_engine.py --device cuda --out prof.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve import LLM, SamplingParams
from pdserve.engine.model_path import resolve_model_path

TOP = 25


def _op_table(prof, key: str, steps: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:TOP]
    return [{"op": e.key, "calls_per_step": e.count / steps,
             "self_us_per_step": getattr(e, key) / steps} for e in rows
            if getattr(e, key) > 0]


def _profile_steps(engine, steps: int, cuda: bool, trace: Path | None) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    durations = []
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                began = time.perf_counter()
                engine.step()
                durations.append(time.perf_counter() - began)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    result = {"steps": steps, "step_ms_median": statistics.median(durations) * 1e3,
              "step_ms": [d * 1e3 for d in durations],
              "host_ops": _op_table(prof, "self_cpu_time_total", steps)}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time for e in kernels)
        result.update({
            "device_ops": _op_table(prof, "self_device_time_total", steps),
            "kernels_per_step": len(kernels) / steps,
            "device_busy_share": busy_us / (sum(durations) * 1e6),
            "syncs_per_step": syncs / steps})
    return result


def _print(phase: str, r: dict) -> None:
    print(f"\n== {phase}: median step {r['step_ms_median']:.2f} ms over {r['steps']} steps")
    if "kernels_per_step" in r:
        print(f"   kernels per step {r['kernels_per_step']:.0f}, device busy "
              f"{r['device_busy_share']:.1%} of the step, host-device syncs per step "
              f"{r['syncs_per_step']:.1f}")
    for title, key in (("host self time", "host_ops"), ("device self time", "device_ops")):
        if key in r:
            print(f"   -- {title} (us per step, calls per step)")
            for row in r[key][:15]:
                print(f"   {row['self_us_per_step']:10.0f} {row['calls_per_step']:7.1f}  "
                      f"{row['op'][:90]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None,
                    help="unset: the engine's default (float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/profile_engine.json")
    ap.add_argument("--trace-dir", default=None, help="write each phase's Chrome trace here")
    args = ap.parse_args()

    llm = LLM(str(resolve_model_path(args.model)), kv_cache_memory_bytes=3 << 30,
              device=args.device, dtype=args.dtype)
    engine = llm.engine
    cuda = engine.config.device.startswith("cuda")
    traces = Path(args.trace_dir) if args.trace_dir else None
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    llm.generate([[7] * 64], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for i in range(args.num_requests):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*args.prompt_range))]
        engine.add_request(f"p{i}", prompt, params)
    result = {"device": engine.config.device, "dtype": engine.config.resolved_dtype,
              "num_requests": args.num_requests, "prompt_range": args.prompt_range,
              "TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED")}
    result["prefill"] = _profile_steps(engine, args.steps, cuda,
                                       traces and traces / "prefill_trace.json")
    while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # decodes only, warm
        engine.step()
    result["decode"] = _profile_steps(engine, args.steps, cuda,
                                      traces and traces / "decode_trace.json")
    result["decodes_per_step"] = len(engine.scheduler.running)
    engine.abort([f"p{i}" for i in range(args.num_requests)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for phase in ("prefill", "decode"):
        _print(phase, result[phase])
    print(f"\n{result['decodes_per_step']} decodes per decode step; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
