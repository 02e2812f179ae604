"""The engine against the device's own limits, in one run, on a real-size model built
from a shipped config with random weights (nothing downloads) and on the tiny model.

1. The device, measured: copy bandwidth (a 1 GiB device-to-device copy; bytes read
   plus written per second) and the dense matmul peak in the model's dtype (8192^3).
2. Decode: the step time of `--decode-batches` sequences (1, 32, 256) each with
   `--context` tokens (1k) of KV, decoding together, against the roofline: the
   weights and the KV a step reads, over the measured bandwidth. The figure is
   roofline / measured (1.0: at the memory floor).
3. Prefill: one prompt of 1k and of 4k tokens in one step; MFU = its matmul and
   attention FLOPs over the step's time, over the measured matmul peak.
4. Throughput: output tokens/s of a mixed workload (seeded lengths, ignore_eos)
   against HF `generate` on the same weights in static batches of 16.
5. Eager against CUDA graphs: each decode row is timed as the engine runs it (decode
   steps replayed from graphs where it captured them) and again with the graphs set
   aside; the graphs' capture time and memory.

The real-size model: `--model llama-3-8b` (`configs/llama-3-8b.json`, Meta's
config.json) gets a small local tokenizer and HF's own random initialization
(seeded) on the device, saved once as safetensors under `--work-dir`, so the engine
and HF load the very same weights. `--model tiny` is the tiny model (what a CPU can
run: `--device cpu --model tiny` is this script's smoke run).

Targets (issue 57, on an H200, Llama-3-8B config): decode at batch 1 >= 0.70 of the
roofline, at batch 256 >= 0.60; prefill MFU at 4k >= 0.50; >= 5x HF generate; the
tiny model's 256-sequence decode step <= 3 ms. Prints JSON and the ratios last;
writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import matmul_params, run_hf, run_pdserve, workload  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.bench.report import save_json  # noqa: E402
from pdserve.engine.model_path import resolve_model_path  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
GIB = 1 << 30


def model_dir(name: str, work: Path, device: str, dtype: torch.dtype) -> Path:
    """The tiny model, or a shipped config's model with HF's random weights, built on
    the device (seed 0) and saved once under `work`."""
    if name == "tiny":
        return resolve_model_path("tiny")
    config = CONFIGS / f"{name}.json"
    if not config.is_file():
        raise SystemExit(f"no config {config}: one of tiny, "
                         + ", ".join(p.stem for p in CONFIGS.glob("*.json")))
    out = work / name
    if (out / "model.safetensors.index.json").is_file() or (out / "model.safetensors").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.engine.tiny_model import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.read_text())
    train_tokenizer(512).save(str(out / "tokenizer.json"))  # ids past it decode to ""
    torch.manual_seed(0)
    began = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out),
                                                 dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(config.read_text())  # as shipped, not as re-saved
    print(f"built {name} with random weights in {time.perf_counter() - began:.0f} s",
          flush=True)
    del model
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_limits(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict:
    """Copy bandwidth (bytes read + written per second) and the matmul peak, the best
    of `repeats` after a warm-up."""
    size = GIB if device.type == "cuda" else GIB // 8
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def best(fn) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)
    copy_s, mm_s = best(lambda: dst.copy_(src)), best(lambda: a @ b)
    return {"copy_bytes": 2 * size, "copy_gb_s": 2 * size / copy_s / 1e9,
            "matmul_n": n, "matmul_tflop_s": 2 * n ** 3 / mm_s / 1e12}


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())


def decode_weight_bytes(llm: LLM, batch: int) -> int:
    """The weights a decode step reads: all of them but the embedding table, of which
    it reads the batch's rows (with tied embeddings the table is read whole, as the
    head)."""
    model = llm.engine.runner.model
    table = model.embed_tokens.weight
    if model.lm_head is None:
        return weight_bytes(llm)
    row = table.shape[1] * table.element_size()
    return weight_bytes(llm) - table.numel() * table.element_size() + batch * row


def kv_bytes_per_token(llm: LLM) -> int:
    cfg = llm.engine.model_config
    element = torch.empty((), dtype=getattr(torch, llm.engine.config.resolved_dtype))
    return cfg.num_layers * 2 * cfg.kv_size * element.element_size()


def decode_steps(llm: LLM, batch: int, context: int, steps: int, limits: dict,
                 seed: int) -> dict:
    """`batch` sequences of `context` prompt tokens decoding `steps` tokens together:
    the median step with all of them decoding, against the roofline."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # Long enough that the first prompts still decode when the last one is in: the
    # prompts take batch * context / max_num_batched_tokens steps.
    prefill_steps = -(-batch * context // engine.config.scheduler.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + prefill_steps + 2, temperature=0,
                            ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}",
                           [rng.randrange(4, vocab) for _ in range(context)], params)
    decoding = [t.duration_s for t in _steps(engine)
                if t.shape.decode_seqs == batch and not t.shape.prefill_tokens][:steps]
    assert decoding, f"no step decoded all {batch} sequences"
    step_s = statistics.median(decoding)
    read = decode_weight_bytes(llm, batch) + batch * (context + prefill_steps + steps // 2) \
        * kv_bytes_per_token(llm)
    floor_s = read / (limits["copy_gb_s"] * 1e9)
    return {"batch": batch, "context": context, "steps_timed": len(decoding),
            "step_ms": step_s * 1e3, "step_ms_min": min(decoding) * 1e3,
            "bytes_read": read, "roofline_ms": floor_s * 1e3, "of_roofline": floor_s / step_s}


def decode_arms(llm: LLM, batch: int, context: int, steps: int, limits: dict,
                seed: int) -> dict:
    """decode_steps as the engine runs them (from CUDA graphs where it captured them),
    and eagerly: the graphs set aside for the second arm."""
    runner = llm.engine.runner
    row = decode_steps(llm, batch, context, steps, limits, seed)
    row["graphs"] = runner.graphs is not None and runner.graphs.capture
    if row["graphs"]:
        graphs, runner.graphs = runner.graphs, None
        try:
            eager = decode_steps(llm, batch, context, steps, limits, seed)
        finally:
            runner.graphs = graphs
        row["eager_step_ms"] = eager["step_ms"]
        row["graphs_speedup"] = eager["step_ms"] / row["step_ms"]
    return row


def _steps(engine) -> list:
    """Steps until nothing is left: each one's timing."""
    timings = []
    while engine.has_unfinished():
        engine.step()
        timings.append(engine.step_timings[-1])
    return timings


def prefill_mfu(llm: LLM, tokens: int, limits: dict, seed: int, repeats: int = 3) -> dict:
    """One prompt of `tokens` in one step, `repeats` fresh prompts: the median step."""
    engine = llm.engine
    cfg = engine.model_config
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for r in range(repeats + 1):  # the first warms up the shapes
        prompt = [rng.randrange(4, cfg.vocab_size) for _ in range(tokens)]
        engine.add_request(f"prefill-{tokens}-{r}", prompt, params)
        steps = _steps(engine)
        assert len(steps) == 1 and steps[0].shape.prefill_tokens == tokens, \
            "the prompt must be one step: raise --max-num-batched-tokens"
        if r:
            times.append(steps[0].duration_s)
    step_s = statistics.median(times)
    # matmuls, causal attention (QK^T and PV: 2 * T^2/2 * q_size each), the last logits
    flops = (2 * matmul_params(llm) * tokens + 2 * cfg.num_layers * tokens ** 2 * cfg.q_size
             + 2 * cfg.hidden_size * cfg.vocab_size)
    return {"tokens": tokens, "step_ms": step_s * 1e3, "flops": flops,
            "tflop_s": flops / step_s / 1e12,
            "mfu": flops / step_s / (limits["matmul_tflop_s"] * 1e12)}


def throughput(llm: LLM, args) -> tuple[dict, list]:
    """pdserve's output tokens/s on the mixed workload, and the workload (HF runs it
    once the engine is gone: both copies of a real-size model do not fit beside the
    engine's KV cache)."""
    requests = workload(args.num_requests, llm.engine.model_config.vocab_size, args.seed,
                        args.prompt_range, args.output_range)
    run_pdserve(llm, requests[:4])  # warm-up
    return run_pdserve(llm, requests), requests


def hf_throughput(path: Path, device: str, dtype: torch.dtype, requests, args) -> dict:
    """HF `generate` on the same requests and weights, in static batches."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        return run_hf(hf, requests, args.hf_batch_size)
    finally:
        del hf
        _free(torch.device(device))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_model(name: str, device: torch.device, dtype: torch.dtype, limits: dict,
              args) -> dict:
    path = model_dir(name, Path(args.work_dir), args.device, dtype)
    began = time.perf_counter()
    llm = LLM(str(path), device=args.device, dtype=str(dtype).removeprefix("torch."),
              max_num_seqs=max(args.decode_batches),
              max_num_batched_tokens=max(max(args.prefill_tokens), 2048),
              enable_prefix_caching=False, attention_backend=args.attention_backend)
    out = {"model": name, "load_s": time.perf_counter() - began,
           "attention_backend": llm.engine.runner.backend.name,
           "weight_bytes": weight_bytes(llm), "kv_bytes_per_token": kv_bytes_per_token(llm)}
    context = min(args.context, llm.engine.model_config.max_position_embeddings - args.steps - 2)
    graphs = llm.engine.runner.graphs
    out["graphs_capture_s"] = graphs.capture_s if graphs else None
    out["graphs_capture_bytes"] = graphs.capture_bytes if graphs else None
    out["decode"] = [decode_arms(llm, b, context, args.steps, limits, args.seed + b)
                     for b in args.decode_batches]
    out["prefill"] = [prefill_mfu(llm, t, limits, args.seed + t) for t in args.prefill_tokens
                      if t < llm.engine.model_config.max_position_embeddings]
    ours, requests = throughput(llm, args) if not args.skip_hf else (None, None)
    for row in out["decode"]:
        arms = (f"eager {row['eager_step_ms']:.2f} ms, graphs {row['graphs_speedup']:.2f}x"
                if row["graphs"] else "eager: no graphs on this device or backend")
        print(f"{name}: decode batch {row['batch']:4d} at {row['context']} tokens: "
              f"{row['step_ms']:.2f} ms a step, roofline {row['roofline_ms']:.2f} ms "
              f"({row['of_roofline']:.3f} of it); {arms}", flush=True)
    for row in out["prefill"]:
        print(f"{name}: prefill {row['tokens']} tokens: {row['step_ms']:.1f} ms, "
              f"{row['tflop_s']:.1f} TFLOP/s, MFU {row['mfu']:.2f}", flush=True)
    del llm
    _free(device)
    if ours is not None:
        theirs = hf_throughput(path, args.device, dtype, requests, args)
        out["throughput"] = {"pdserve": ours, "hf": theirs,
                             "ratio": ours["output_tok_s"] / theirs["output_tok_s"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "tiny"],
                    help="tiny, or a config under benchmarks/configs (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (tiny only)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(128, 1024))
    ap.add_argument("--output-range", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="bench-results/models",
                    help="where a real-size model's random weights are saved once")
    ap.add_argument("--out", default="bench-results/engine_gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and args.models != ["tiny"]:
        raise SystemExit("a real-size model needs --device cuda (on cpu: --models tiny)")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    limits = device_limits(device, dtype)
    print(f"{args.device}: copy {limits['copy_gb_s']:.0f} GB/s, {dtype} matmul "
          f"{limits['matmul_tflop_s']:.1f} TFLOP/s", flush=True)
    result = {"device": args.device, "device_name": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "limits": limits, "models": []}
    for name in args.models:  # written after each: a run cut short keeps what it measured
        result["models"].append(run_model(name, device, dtype, limits, args))
        save_json(args.out, result)
    print(f"wrote {args.out}")
    for m in result["models"]:
        for row in m["decode"]:
            print(f"{m['model']}: decode at batch {row['batch']}: {row['of_roofline']:.3f} of "
                  f"the memory roofline ({row['step_ms']:.2f} ms a step)")
        for row in m["prefill"]:
            print(f"{m['model']}: prefill MFU at {row['tokens']} tokens: {row['mfu']:.2f}")
        if "throughput" in m:
            print(f"{m['model']}: output tok/s / HF generate: {m['throughput']['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
