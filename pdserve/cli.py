"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the offline engine on the tiny model")
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--num-prompts", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.set_defaults(func=_demo)

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight HF model + tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny)

    args = parser.parse_args(argv)
    return args.func(args) or 0


def _demo(args) -> int:
    from pdserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory_bytes=512 << 20)
    print(f"loaded {args.model!r} in {time.perf_counter() - t0:.1f}s "
          f"({llm.engine.model_config.num_layers} layers, "
          f"{llm.engine.block_manager.num_blocks} KV blocks)")
    topics = ["The history of", "A recipe for", "def fibonacci(n):", "Dear reader,",
              "import numpy as np\n", "In the beginning", "The weather today", "Once upon a time"]
    prompts = [f"{topics[i % len(topics)]} {i}" for i in range(args.num_prompts)]
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


def _make_tiny(args) -> int:
    from dataclasses import replace

    from engine.tiny_model import TINY, make_tiny_model

    path = make_tiny_model(args.dir, replace(TINY, seed=args.seed))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
