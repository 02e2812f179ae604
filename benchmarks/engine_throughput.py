"""Engine throughput against HF transformers, in one process on one model.

1. Mixed offline workload (seeded prompt / output lengths, ignore_eos): pdserve output
   tokens/s divided by HF `generate` over the same requests in static batches of 16
   (and, where the engine packs its weights, divided by HF with every nn.Linear on the
   engine's own packed matmul: how much of the ratio is the engine, not its GEMM),
   in --rounds rounds, each running every arm on its own requests (seed + 1000 x round:
   no prompt is seen twice, so no prefix-cache hit; the order reverses every round); the
   ratio is the median of the rounds' ratios, with their spread (this machine's speed
   drifts by +-8% within minutes, and a single pair is a draw).
2. Prefill efficiency: prefill tokens/s x 2 x matmul parameters, divided by the FLOP/s
   the engine's own matmul (`engine/model/linear.py`: oneDNN over packed weights on a
   CPU) reaches at the model's linear shapes (measured after every step, and paired
   with it: a step's duration is schedule to outputs). Also, where the engine packs,
   against F.linear unpacked (MKL's sgemm on a CPU: the engine's kernel before, and as
   fast as torch.mm, the reference then), so figures from before compare.
   "Matmul parameters" are the weights every prompt token multiplies (q/k/v/o,
   gate/up/down of every layer); the embedding lookup and the lm_head (run only for
   each prompt's last token) are left out.
3. Scheduler overhead: microseconds per schedule() + update() with 256 running decodes,
   in five fresh processes (this machine's speed differs by process).

`--device cuda` runs all three on a GPU (the engine in its dtype there, bfloat16 unless
`--dtype` says, HF and the matmul reference in the same one).

Prints JSON and the ratios last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import show, spread
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.model.linear import linear, pack, packs
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput


def workload(num: int, vocab: int, seed: int, prompt_range, output_range):
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(num)]


def run_pdserve(llm: LLM, requests) -> dict:
    """Output tokens/s, and the engine's per-step Python overhead (everything a step
    does besides the model runner's forward pass and sampling) as a share of that
    pass: what grows when the scheduler or the output path gets heavier."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    runner, forward_s = llm.engine.runner, [0.0]
    execute = runner.execute

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - began
    runner.execute = timed
    steps_before = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - t0
    runner.execute = execute
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in requests)
    steps = llm.engine.num_steps - steps_before
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "steps": steps, "forward_s": forward_s[0],
            "overhead_per_step_us": (elapsed - forward_s[0]) / steps * 1e6,
            "overhead_ratio": (elapsed - forward_s[0]) / forward_s[0]}


def load_hf(model_dir: Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def engine_packs(llm: LLM) -> bool:
    """Whether the engine's matmuls run packed on its device and dtype (linear.py)."""
    config = llm.engine.config
    return packs(config.device, getattr(torch, config.resolved_dtype))


def with_engine_matmuls(model) -> None:
    """HF's model with every nn.Linear's forward on the engine's matmul over a packed
    copy of its weight (engine/model/linear.py); only where engine_packs."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [pack(m.weight) for m in layers]
    assert all(w is not None for w in packed), "the engine packs no weight here"
    for module, weight in zip(layers, packed):
        module.forward = (lambda x, m=module, w=weight: linear(x, None, m.bias, w))


def run_hf(model, requests, batch_size: int) -> dict:
    device = model.device
    pad = 0
    t0 = time.perf_counter()
    tokens = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch],
                            device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(n for _, n in batch),
                                 eos_token_id=None, pad_token_id=pad)
        tokens += sum(min(n, out.shape[1] - width) for _, n in batch)  # out is on the host
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "batch_size": batch_size}


class MatmulReference:
    """The engine's matmul (`linear`, over weights packed as the engine packs them;
    unpacked: F.linear's kernel) at the model's linear shapes and `rows` rows (weighted
    as in one forward pass), on the engine's device and in its dtype: the FLOP/s a
    step's matmuls could reach on this machine now."""

    def __init__(self, llm: LLM, rows: int, packed: bool = True):
        cfg = llm.engine.model_config
        config = llm.engine.config
        self.device = torch.device(config.device)
        kw = {"device": self.device, "dtype": getattr(torch, config.resolved_dtype)}
        shapes = [(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size),
                  (cfg.q_size, cfg.hidden_size),
                  (cfg.hidden_size, 2 * cfg.intermediate_size),
                  (cfg.intermediate_size, cfg.hidden_size)]
        self.flops = sum(2 * rows * k * n for k, n in shapes)
        self.xs = []
        for k, n in shapes:
            weight = torch.randn(n, k, **kw)
            self.xs.append((torch.randn(rows, k, **kw), weight,
                            pack(weight) if packed else None))
        self.flop_s()  # warm-up

    def flop_s(self, repeats: int = 3) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for x, weight, packed in self.xs:
                linear(x, weight, None, packed)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return self.flops / best


def matmul_params(llm: LLM) -> int:
    cfg = llm.engine.model_config
    per_layer = (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    return per_layer * cfg.num_layers


def prefill_efficiency(llm: LLM, num: int, prompt_range, seed: int, rounds: int = 3) -> dict:
    """Prefill-only load (distinct prompts, one output token each: no prefix hits)
    against the engine's matmul over the model's shapes, paired step by step: the reference is
    measured right after each step, and a round's efficiency is its steps' matmul
    FLOPs over what their durations at those references allow. This machine's speed
    drifts within seconds (the reference read 115-161 GFLOP/s within one run), so a
    reference taken once per round moved the figure by +-15%. The median of
    `rounds` rounds (each its own prompts), with their spread."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    warmup = [p for p, _ in workload(4, vocab, seed + 2, prompt_range, (1, 1))]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(warmup, params)
    rows = engine.config.scheduler.max_num_batched_tokens
    references = {"engine": MatmulReference(llm, rows)}
    if engine_packs(llm):
        references["unpacked"] = MatmulReference(llm, rows, packed=False)
    flops_per_token = 2 * matmul_params(llm)
    runs = []
    for round_ in range(rounds):
        prompts = [p for p, _ in workload(num, vocab, seed + 10 + round_, prompt_range, (1, 1))]
        hits = engine.stats.prefix_cache_hits
        for i, prompt in enumerate(prompts):
            engine.add_request(f"prefill-{round_}-{i}", prompt, params)
        tokens = seconds = 0.0
        allowed = dict.fromkeys(references, 0.0)
        while engine.has_unfinished():
            engine.step()
            step = engine.step_timings[-1]
            tokens += step.shape.prefill_tokens
            seconds += step.duration_s
            for name, reference in references.items():
                allowed[name] += step.duration_s * reference.flop_s()
        assert engine.stats.prefix_cache_hits == hits, "prefill load must not hit the cache"
        assert tokens == sum(map(len, prompts))
        run = {"prefill_tok_s": tokens / seconds, "mm_flop_s": allowed["engine"] / seconds,
               "efficiency": tokens * flops_per_token / allowed["engine"]}
        if "unpacked" in allowed:
            run["unpacked_flop_s"] = allowed["unpacked"] / seconds
            run["efficiency_unpacked"] = tokens * flops_per_token / allowed["unpacked"]
        runs.append(run)
    return {"matmul_params": matmul_params(llm), "mm_rows": rows, "rounds": runs,
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "efficiency": statistics.median(r["efficiency"] for r in runs),
            "efficiency_runs": [r["efficiency"] for r in runs],
            "efficiency_unpacked_runs": [r["efficiency_unpacked"] for r in runs
                                         if "efficiency_unpacked" in r]}


def scheduler_overhead(processes: int = 5) -> dict:
    """_scheduler_runs in `processes` fresh processes, one after another: this
    machine runs the same loop at ~100 or ~175 us depending on the process (steady
    within one, whatever the time or the core), so one process's figure is a draw."""
    spawn = multiprocessing.get_context("spawn")
    per_process = []
    for _ in range(processes):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            per_process.append(pool.submit(_scheduler_runs).result())
    medians = [statistics.median(runs) for runs in per_process]
    return {"us_per_step": statistics.median(medians),
            "us_per_step_processes": medians, "us_per_step_runs": per_process}


def _scheduler_runs(num: int = 256, steps: int = 400, repeats: int = 5) -> list[float]:
    """Schedule + update of `num` running decodes, no model: `repeats` runs of `steps`
    steps each (one block boundary per request every 16 steps in each), us per step."""
    # Room for every request to grow by all the steps: no preemption in the timed loops.
    blocks = num * ((200 + steps * repeats) // 16 + 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num), BlockManager(blocks, 16))
    for i in range(num):
        sched.add_request(Request(f"r{i}", list(range(1, 200)), SamplingParams(
            max_tokens=10**6, ignore_eos=True), 0.0))
    sampled = ModelRunnerOutput({f"r{i}": 5 for i in range(num)})
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):  # prefills
        sched.update(sched.schedule(), sampled)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = sched.schedule()
            sched.update(out, sampled)
        runs.append((time.perf_counter() - t0) / steps * 1e6)
    assert len(out.requests) == num and sched.stats.num_preemptions == 0
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    ap.add_argument("--output-range", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of the throughput comparison (each runs every arm)")
    ap.add_argument("--prefill-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None,
                    help="unset: the engine's default (float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--skip-hf", action="store_true", help="only pdserve's own figures")
    ap.add_argument("--out", default="bench-results/engine_throughput.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_path(args.model)
    llm = LLM(str(model_dir), kv_cache_memory_bytes=3 << 30, device=args.device,
              dtype=args.dtype)
    dtype = llm.engine.config.resolved_dtype
    vocab = llm.engine.model_config.vocab_size
    result = {"model": str(model_dir), "threads": torch.get_num_threads(),
              "num_requests": args.num_requests, "prompt_range": args.prompt_range,
              "output_range": args.output_range, "device": args.device, "dtype": dtype}
    result["scheduler"] = scheduler_overhead()
    print(f"scheduler: {show(spread(result['scheduler']['us_per_step_processes']), 0)} us "
          "per step (processes' medians)", flush=True)
    result["prefill"] = prefill_efficiency(llm, args.prefill_requests, args.prompt_range,
                                           args.seed)
    print(f"prefill: {result['prefill']['prefill_tok_s']:.0f} tok/s", flush=True)
    llm.generate([[7] * 64], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    hf = None if args.skip_hf else load_hf(model_dir, args.device, dtype)
    hf_packed = None
    if not args.skip_hf and engine_packs(llm):
        hf_packed = load_hf(model_dir, args.device, dtype)
        with_engine_matmuls(hf_packed)
    ours_runs, hf_runs, hf_packed_runs = [], [], []
    for round_ in range(args.rounds):
        # Seeds far from the prefill rounds' (seed + 2, + 10...): no prompt seen before.
        requests = workload(args.num_requests, vocab, args.seed + 1000 * round_,
                            args.prompt_range, args.output_range)
        # The order reverses every round, so a drift over the run favours no arm.
        arms = ("pdserve", "hf", "hf_packed")
        for arm in (arms if round_ % 2 == 0 else arms[::-1]):
            if arm == "pdserve":
                ours_runs.append(run_pdserve(llm, requests))
            elif arm == "hf" and hf is not None:
                hf_runs.append(run_hf(hf, requests, args.hf_batch_size))
            elif arm == "hf_packed" and hf_packed is not None:
                hf_packed_runs.append(run_hf(hf_packed, requests, args.hf_batch_size))
        print(f"round {round_ + 1}/{args.rounds}: pdserve "
              f"{ours_runs[-1]['output_tok_s']:.0f} output tok/s"
              + (f", hf {hf_runs[-1]['output_tok_s']:.0f}" if hf_runs else "")
              + (f", hf on the engine's matmuls {hf_packed_runs[-1]['output_tok_s']:.0f}"
                 if hf_packed_runs else ""), flush=True)
    result["pdserve"] = {"rounds": ours_runs, "output_tok_s": spread(
        [r["output_tok_s"] for r in ours_runs])}
    overhead = spread([r["overhead_ratio"] for r in ours_runs])
    result["pdserve"]["overhead_ratio"] = overhead
    if hf_runs:
        result["hf"] = {"rounds": hf_runs, "batch_size": args.hf_batch_size,
                        "output_tok_s": spread([r["output_tok_s"] for r in hf_runs])}
        result["throughput_ratio_rounds"] = spread(
            [ours["output_tok_s"] / theirs["output_tok_s"]
             for ours, theirs in zip(ours_runs, hf_runs)])
        result["throughput_ratio"] = result["throughput_ratio_rounds"]["median"]
    if hf_packed_runs:
        result["hf_engine_matmuls"] = {
            "rounds": hf_packed_runs, "output_tok_s": spread(
                [r["output_tok_s"] for r in hf_packed_runs])}
        result["throughput_ratio_same_matmuls_rounds"] = spread(
            [ours["output_tok_s"] / theirs["output_tok_s"]
             for ours, theirs in zip(ours_runs, hf_packed_runs)])
    result["prefill_efficiency"] = result["prefill"]["efficiency"]
    result["scheduler_us"] = result["scheduler"]["us_per_step"]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if "throughput_ratio" in result:
        print(f"throughput ratio pdserve / HF static batches of {args.hf_batch_size}: "
              f"{show(result['throughput_ratio_rounds'])}, median [min, max] of "
              f"{args.rounds} rounds (target >= 3.3)")
    if "throughput_ratio_same_matmuls_rounds" in result:
        print(f"  against HF on the engine's own matmuls: "
              f"{show(result['throughput_ratio_same_matmuls_rounds'])}")
    unpacked = result["prefill"]["efficiency_unpacked_runs"]
    print(f"prefill efficiency: {show(spread(result['prefill']['efficiency_runs']))} "
          "against the engine's matmul (target >= 0.8)"
          + (f"; {show(spread(unpacked))} against F.linear unpacked" if unpacked else ""))
    print(f"per-step Python overhead / forward pass: "
          f"{show(result['pdserve']['overhead_ratio'], 3)}")
    print(f"scheduler overhead: {show(spread(result['scheduler']['us_per_step_processes']), 0)}"
          " us per schedule+update with 256 decodes, median [min, max] of "
          f"{len(result['scheduler']['us_per_step_processes'])} processes (target <= 100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
