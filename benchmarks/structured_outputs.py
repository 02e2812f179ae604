"""What structured outputs cost a decode step: --batch requests decoding together,
unconstrained against the same requests held to a JSON schema (and to a regular
expression), on one engine, the arms interleaved within each round and the rounds
repeated to show the spread.

Each arm prefills the batch, then times every engine step while all of its requests
decode (so a step is --batch decode rows): the step time is the mean of those. A
constrained step adds, per request, bringing its grammar matcher up to its new token
and filling its row of the token bitmask, then one masking pass over the batch's
logits (engine/structured_outputs.py); the filling is also timed on its own (`fill`:
host work that on a GPU runs while the step's kernels do, before the sampler's first
wait for the device; on a CPU it adds to the step).
The schema (an array of objects) and the regex (words and numbers) are ones a random
model does not finish within --max-tokens, so every step of the run is constrained
(the share still constrained at the end is reported).

Target: a constrained step <= 1.10x the unconstrained one at batch 32 on the tiny
model. Its vocabulary is 8k tokens; a real model's (150k) makes each bitmask row and
the masking pass ~18x larger, not the matcher's per-token work.

Prints each arm's figures, the ratios last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import save_json, show, spread
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 16, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}
CONSTRAINTS = {
    "free": None,
    "json_schema": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputsParams(regex=r"([a-z]+ [0-9]+, )+"),
}


def run_arm(llm: LLM, prompts: list[list[int]], constraint, args, tag: str) -> dict:
    """The batch through prefill, then its decode steps timed one by one."""
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                            structured_outputs=constraint)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    masking = [0.0]
    real_fill = engine.grammars.fill

    def timed_fill(*a, **kw):  # the benchmark's stopwatch around the bitmask's making
        start = time.perf_counter()
        try:
            return real_fill(*a, **kw)
        finally:
            masking[0] += time.perf_counter() - start
    engine.grammars.fill = timed_fill
    outputs: dict[str, list[int]] = {}
    steps, step_s, mask_s = 0, 0.0, 0.0
    try:
        while engine.has_unfinished():
            running = engine.scheduler.running
            steady = (len(running) == len(prompts) and not engine.scheduler.waiting
                      and all(r.num_output_tokens > 0 for r in running))
            masking[0] = 0.0
            start = time.perf_counter()
            outs = engine.step()
            if steady:
                step_s += time.perf_counter() - start
                mask_s += masking[0]
                steps += 1
            for out in outs:
                if out.finished:
                    outputs[out.request_id] = out.token_ids
    finally:
        engine.grammars.fill = real_fill
    constrained = 0
    if constraint is not None:  # the grammars not yet complete at the end
        constrained = sum(1 for toks in outputs.values() if _open(llm, constraint, toks))
    return {"step_s": step_s / steps, "fill_s_per_step": mask_s / steps,
            "steps": steps, "still_constrained_share": constrained / len(prompts),
            "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))]}


def _open(llm: LLM, constraint, tokens: list[int]) -> bool:
    """Whether the output is inside the grammar and not finished by it."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(llm.engine.grammars.compile(constraint))
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return False
    return not matcher.is_terminated()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench-results/structured_outputs.json")
    args = parser.parse_args(argv)
    model_dir = resolve_model_path(args.model)
    llm = LLM(str(model_dir), device=args.device, max_num_seqs=args.batch,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    for constraint in CONSTRAINTS.values():  # compiled (cached) and warmed once
        run_arm(llm, [list(range(10, 20))], constraint, argparse.Namespace(max_tokens=4),
                "warm")
    runs: dict[str, list] = {name: [] for name in CONSTRAINTS}
    for round_ in range(args.repeats):
        rng = random.Random(round_)
        prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.batch)]
        order = list(CONSTRAINTS) if round_ % 2 == 0 else list(reversed(CONSTRAINTS))
        for name in order:
            runs[name].append(run_arm(llm, prompts, CONSTRAINTS[name], args,
                                      f"r{round_}-{name}"))
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    ratios = {f"{name}_step_x": spread([c["step_s"] / f["step_s"]
                                        for c, f in zip(runs[name], runs["free"])])
              for name in CONSTRAINTS if name != "free"}
    figures = {name: {key: spread([r[key] for r in rs]) for key in rs[0] if key != "outputs"}
               for name, rs in runs.items()}
    result = {"model": str(model_dir), "device": args.device, "vocab": vocab,
              "threads": torch.get_num_threads(), "args": vars(args), "figures": figures,
              "ratios": ratios, "targets": {f"{n}_step_x": "<= 1.10" for n in CONSTRAINTS
                                            if n != "free"}}
    save_json(args.out, result)
    for name, figs in figures.items():
        print(name, {k: show(v, 4) for k, v in figs.items()})
    print("ratios, constrained step over free step (median [min, max] over rounds):")
    for name, value in ratios.items():
        print(f"  {name}: {show(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
