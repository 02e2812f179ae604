"""n = 4 from one prefill against four separate requests for the same prompt, on one
engine, the arms interleaved within each round and the rounds repeated to show the
spread.

`n4` is one request with SamplingParams(n=4, seed=s): its prompt is computed once, its
four choices fork from it at its first token (choice i draws with seed s + i) and
share the prompt's KV blocks, the last partly filled one copied on first write.
`separate` is four requests, seeds s .. s+3, added together (as four clients would
send them): the same tokens come out (checked), but each computes its prompt (prefix
caching finds a block only once a request has computed it, so requests admitted in
the same step share nothing).

Reported per arm: prompt tokens computed (admitted minus prefix-cache hits), the most
KV blocks held at once while the prompts are prefilled (the prompt's KV), the time
until every sequence has its first token (prefill), and until all finished. Target:
the n = 4 prompt computed once (a quarter of the tokens) and its KV held once.

Prints each arm's figures, the ratios (separate over n4) last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import save_json, show, spread
from pdserve.engine.model_path import resolve_model_path

N = 4


def run_arm(llm: LLM, prompt: list[int], seed: int, together: bool, args, tag: str) -> dict:
    """One prompt's N sequences: one request for N (together) or N requests."""
    engine, bm = llm.engine, llm.engine.block_manager
    sampled = dict(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
    stats = engine.stats
    admitted, hits = stats.prompt_tokens, stats.prefix_cache_hits
    started = time.perf_counter()
    if together:
        engine.add_request(f"{tag}-0", prompt, SamplingParams(n=N, seed=seed, **sampled))
    else:
        for i in range(N):
            engine.add_request(f"{tag}-{i}", prompt, SamplingParams(seed=seed + i, **sampled))
    firsts: set[str] = set()
    outputs: dict[str, list[int]] = {}
    peak_prefill_blocks, prefill_s = 0, None
    while engine.has_unfinished():
        outs = engine.step()
        used = bm.num_blocks - bm.num_free_blocks
        if prefill_s is None:
            peak_prefill_blocks = max(peak_prefill_blocks, used)
        for out in outs:
            if out.new_token_ids:
                firsts.add(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if prefill_s is None and len(firsts) == N:
            prefill_s = time.perf_counter() - started
    total_s = time.perf_counter() - started
    return {"prompt_tokens_computed": (stats.prompt_tokens - admitted)
            - (stats.prefix_cache_hits - hits),
            "prompt_kv_blocks": peak_prefill_blocks, "prefill_s": prefill_s,
            "total_s": total_s, "outputs": [outputs[k] for k in sorted(outputs)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench-results/parallel_sampling.json")
    args = parser.parse_args(argv)
    model_dir = resolve_model_path(args.model)
    llm = LLM(str(model_dir), device=args.device, kv_cache_memory_bytes=256 << 20)
    vocab = llm.engine.model_config.vocab_size
    warm = [random.Random(99).randrange(4, vocab) for _ in range(args.prompt_len)]
    run_arm(llm, warm, 1, True, args, "warm-n")
    run_arm(llm, warm[::-1], 1, False, args, "warm-s")
    runs: dict[str, list] = {"n4": [], "separate": []}
    for round_ in range(args.repeats):
        rng = random.Random(round_)
        # a fresh prompt per arm: neither finds the other's prefix cached
        prompts = {arm: [rng.randrange(4, vocab) for _ in range(args.prompt_len)]
                   for arm in runs}
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for arm in order:
            runs[arm].append(run_arm(llm, prompts[arm], 1000 + round_, arm == "n4", args,
                                     f"r{round_}-{arm}"))
        # the same sampling, checked on the n4 arm's prompt: the same tokens either way
        same = run_arm(llm, prompts["n4"], 1000 + round_, False, args, f"r{round_}-check")
        assert same["outputs"] == runs["n4"][-1]["outputs"], "n = 4 differs from seed + i"
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    keys = ("prompt_tokens_computed", "prompt_kv_blocks", "prefill_s", "total_s")
    figures = {arm: {k: spread([r[k] for r in rs]) for k in keys} for arm, rs in runs.items()}
    ratios = {f"{k}_x": spread([s[k] / n[k] for s, n in zip(runs["separate"], runs["n4"])])
              for k in keys}
    result = {"model": str(model_dir), "device": args.device, "n": N,
              "threads": torch.get_num_threads(), "args": vars(args), "figures": figures,
              "ratios": ratios, "targets": {"prompt_tokens_computed_x": f"{N} (once, not "
                                            f"{N} times)", "prompt_kv_blocks_x": f"~{N}"}}
    save_json(args.out, result)
    for arm, figs in figures.items():
        print(arm, {k: show(v, 4) for k, v in figs.items()})
    print(f"ratios, {N} separate requests over one request for n = {N} "
          "(median [min, max] over rounds):")
    for name, value in ratios.items():
        print(f"  {name}: {show(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
