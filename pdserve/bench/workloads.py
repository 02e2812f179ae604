"""Seeded, locally generated request workloads (no datasets are downloaded).

Length distributions are lognormal, fitted to each published median and p99 (the
tail matters most for goodput), clipped to [1, max]. `scale` shrinks every length so
a small model's context fits; prompts are random token ids from the vocabulary.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

_Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # token ids, or text the server tokenizes
    max_tokens: int
    timestamp: float | None = None  # seconds from the start, from a trace file


@dataclass(frozen=True)
class LengthDist:
    median: float
    p99: float
    maximum: int

    def sample(self, rng: random.Random, scale: float) -> int:
        sigma = math.log(self.p99 / self.median) / _Z99
        value = rng.lognormvariate(math.log(self.median), sigma) * scale
        return max(1, min(int(round(value)), max(1, int(self.maximum * scale))))


# (input, output) as published: mean / median / p99.
PROFILES = {
    "sharegpt-like": (LengthDist(160, 1000, 4096), LengthDist(130, 900, 2048)),
    "azure-conv": (LengthDist(1020, 4142, 8192), LengthDist(129, 601, 2048)),
    "azure-code": (LengthDist(1469, 7436, 8192), LengthDist(13, 251, 2048)),
}


def make_workload(name: str, num: int, vocab_size: int, seed: int = 0, scale: float = 1.0,
                  input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                  prefix_share: float = 0.5, prefix_len: int = 256,
                  path: str | None = None) -> list[BenchRequest]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab_size) for _ in range(n)]

    if name == "random":
        # vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)].
        def around(n: int) -> int:
            low, high = int(n * (1 - range_ratio) * scale), int(n * (1 + range_ratio) * scale)
            return max(1, rng.randint(max(1, low), max(1, high)))
        return [BenchRequest(tokens(around(input_len)), around(output_len)) for _ in range(num)]
    if name in PROFILES:
        inp, out = PROFILES[name]
        return [BenchRequest(tokens(inp.sample(rng, scale)), out.sample(rng, scale))
                for _ in range(num)]
    if name == "prefix-shared":
        groups = [tokens(max(1, int(prefix_len * scale))) for _ in range(4)]
        reqs = []
        for _ in range(num):
            suffix = tokens(max(1, int(input_len * scale)))
            prefix = rng.choice(groups) if rng.random() < prefix_share else []
            reqs.append(BenchRequest(prefix + suffix, max(1, int(output_len * scale))))
        return reqs
    if name == "file":
        if path is None:
            raise ValueError("workload 'file' needs a JSONL path")
        return load_jsonl(path)
    raise ValueError(f"unknown workload {name!r}: random, {', '.join(PROFILES)}, "
                     "prefix-shared, file")


def load_jsonl(path: str) -> list[BenchRequest]:
    """Lines of {prompt | prompt_token_ids, max_tokens, timestamp?}."""
    reqs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt_token_ids", row.get("prompt"))
        if prompt is None or "max_tokens" not in row:
            raise ValueError(f"{path}:{number}: needs prompt or prompt_token_ids, and max_tokens")
        reqs.append(BenchRequest(prompt, int(row["max_tokens"]), row.get("timestamp")))
    return reqs
