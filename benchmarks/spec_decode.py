"""Speculative decoding: output tokens/s and TPOT with and without it, in one process
on one model, each arm's engine built once and the rounds interleaved (every arm runs
once per round; ratios are taken within a round), repeated to show the spread.

Workloads (ignore_eos, `--requests` at once, prefix caching off so that every round
computes the same prompts):
- repeat (greedy): outputs that repeat their prompt. Each prompt is a random start
  followed by the model's own first greedy tokens after it, up to where its output
  has entered a cycle (random-weight models end in one); the output is the rest of
  that same generation, so it repeats what the prompt ends with. Prompt lookup's best
  case.
- random (seeded sampling at temperature 1): random prompts, outputs that do not
  repeat; prompt lookup finds next to nothing and speculation must not cost more than
  5% here. Seeded, so every arm must draw the very same tokens.

Arms: no speculation; prompt lookup (ngram) with k in --ks; a draft model built from
the target (its first --draft-layers layers: same tokenizer, a fraction of the cost;
random weights agree little, so it shows the cost of drafts that miss); the target
as its own draft (every draft accepted: the upper bound of acceptance, at its cost).

`--device cuda` runs every arm on a GPU (bfloat16 there unless `--dtype` says).

Prints each arm's figures, acceptance (accepted / proposed drafts, by position) and
the ratios to no speculation last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import save_json, show, spread
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.tiny_model import make_draft_model

KV_BYTES = 128 << 20


def cyclic_from(tokens: list[int]) -> int:
    """Where the greedy output has entered its final cycle (period <= 16)."""
    for period in range(1, 17):
        start = len(tokens) - period
        while start > 0 and tokens[start - 1] == tokens[start - 1 + period]:
            start -= 1
        if len(tokens) - start >= 3 * period:
            return start
    return len(tokens)


def workloads(llm: LLM, args) -> dict[str, list[list[int]]]:
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    starts = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)]
              for _ in range(args.requests)]
    long = llm.generate(starts, SamplingParams(max_tokens=args.warm_len, temperature=0,
                                               ignore_eos=True))
    repeat = []
    for start, out in zip(starts, long):
        tokens = out.token_ids
        cut = max(cyclic_from(tokens), 1)
        cut = min(cut + args.output_len // 2, len(tokens) - args.output_len)
        repeat.append(start + tokens[:cut])  # the output goes on with the cycle
    randoms = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    return {"repeat": (repeat, [greedy] * len(repeat)),
            "random": (randoms, [SamplingParams(max_tokens=args.output_len, temperature=1.0,
                                                seed=i, ignore_eos=True)
                                 for i in range(len(randoms))])}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    stats = llm.engine.stats
    before = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
              list(stats.spec_decode_num_accepted_tokens_per_pos),
              stats.spec_decode_num_drafts, llm.engine.num_steps)
    began = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outs)
    tpot = statistics.mean((o.metrics.finished_time - o.metrics.first_token_time)
                           / (len(o.token_ids) - 1) for o in outs)
    drafts = stats.spec_decode_num_draft_tokens - before[0]
    accepted = stats.spec_decode_num_accepted_tokens - before[1]
    per_pos = [a - (before[2][i] if i < len(before[2]) else 0)
               for i, a in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
    return {"seconds": elapsed, "output_tok_s": tokens / elapsed, "tpot_ms": tpot * 1e3,
            "steps": llm.engine.num_steps - before[4], "draft_tokens": drafts,
            "accepted_tokens": accepted, "verifications": stats.spec_decode_num_drafts - before[3],
            "accepted_per_pos": per_pos, "outputs": [o.token_ids for o in outs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warm-len", type=int, default=320,
                    help="greedy tokens generated to find each start's cycle")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None,
                    help="unset: the engine's default (float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--out", default="bench-results/spec_decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    draft_dir = make_draft_model(model_dir, Path(args.out).parent / f"draft-{args.draft_layers}",
                                 args.draft_layers)
    arms = {"none": None}
    for k in args.ks:
        arms[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                "prompt_lookup_min": args.prompt_lookup_min,
                                "prompt_lookup_max": args.prompt_lookup_max}
    for k in args.ks:
        arms[f"draft({args.draft_layers} layers) k={k}"] = {
            "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    for k in args.ks:
        arms[f"target as draft k={k}"] = {"method": "draft_model", "model": str(model_dir),
                                          "num_speculative_tokens": k}
    engines = {name: LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES,
                         enable_prefix_caching=False, speculative_config=spec,
                         device=args.device, dtype=args.dtype)
               for name, spec in arms.items()}
    loads = workloads(engines["none"], args)
    for llm in engines.values():  # warm-up
        llm.generate([loads["random"][0][0]], SamplingParams(max_tokens=8, temperature=0))
    runs = {(name, load): [] for name in arms for load in loads}
    for round_ in range(args.repeats):
        for load, (prompts, params) in loads.items():
            for name, llm in engines.items():
                runs[name, load].append(run(llm, prompts, params))
            print(f"round {round_ + 1}/{args.repeats} {load} done", flush=True)
    result = {"model": str(model_dir), "threads": torch.get_num_threads(),
              "args": vars(args), "arms": arms, "workloads": {}}
    for load in loads:
        base = runs["none", load]
        summary = {}
        for name in arms:
            rs = runs[name, load]
            # Every arm emits the very tokens of no speculation (greedy, or seeded draws).
            exact = all(r["outputs"] == b["outputs"] for r, b in zip(rs, base))
            drafts = sum(r["draft_tokens"] for r in rs)
            accepted = sum(r["accepted_tokens"] for r in rs)
            verifications = sum(r["verifications"] for r in rs)
            per_pos = [sum(r["accepted_per_pos"][i] for r in rs if i < len(r["accepted_per_pos"]))
                       for i in range(max((len(r["accepted_per_pos"]) for r in rs), default=0))]
            summary[name] = {
                "output_tok_s": spread([r["output_tok_s"] for r in rs]),
                "tpot_ms": spread([r["tpot_ms"] for r in rs]),
                "throughput_ratio": spread([r["output_tok_s"] / b["output_tok_s"]
                                            for r, b in zip(rs, base)]),
                "tpot_ratio": spread([r["tpot_ms"] / b["tpot_ms"] for r, b in zip(rs, base)]),
                "steps": rs[0]["steps"], "same_tokens_as_none": exact,
                "acceptance_rate": accepted / drafts if drafts else None,
                "mean_accepted_per_verification": accepted / verifications if verifications else None,
                "acceptance_per_position": [a / verifications for a in per_pos] if verifications else [],
            }
        result["workloads"][load] = summary
    path = save_json(args.out, result)
    for load, summary in result["workloads"].items():
        print(f"\n{load}: {args.requests} requests x {args.output_len} tokens")
        for name, s in summary.items():
            rate = "" if s["acceptance_rate"] is None else (
                f", acceptance {s['acceptance_rate']:.2f} by position "
                + " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]))
            print(f"  {name:28s} {show(s['output_tok_s'], 0)} tok/s, TPOT "
                  f"{show(s['tpot_ms'], 1)} ms, {s['steps']} steps{rate}"
                  + ("" if s["same_tokens_as_none"] else "  (TOKENS DIFFER)"))
    print(f"\nwritten to {path}")
    for load, summary in result["workloads"].items():
        print(f"\n{load}: throughput / no speculation (median [min, max] of "
              f"{args.repeats} rounds), TPOT / no speculation")
        for name, s in summary.items():
            if name != "none":
                print(f"  {name:28s} {show(s['throughput_ratio'])}   TPOT {show(s['tpot_ratio'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
