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
from typing import TYPE_CHECKING, Iterable, Iterator

from pdserve.router.policy.prefix_index import block_hashes

if TYPE_CHECKING:
    from pdserve.bench.sessions import Session, SessionShape

_Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # token ids, or text the server tokenizes
    max_tokens: int
    timestamp: float | None = None  # seconds from the start, from a trace file
    session: int | None = None  # sessions workload: the session's number
    turn: int | None = None  # and the turn's in it, from 1


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


WORKLOADS = ("random", *PROFILES, "prefix-shared", "conversations", "sessions", "file")


def make_workload(*args, **kwargs) -> list[BenchRequest | Session]:
    """iter_workload's requests (the same arguments), as a list."""
    return list(iter_workload(*args, **kwargs))


def iter_workload(name: str, num: int, vocab_size: int, seed: int = 0, scale: float = 1.0,
                  input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                  prefix_share: float = 0.5, prefix_len: int = 256,
                  path: str | None = None, sessions: SessionShape | None = None,
                  ) -> Iterable[BenchRequest | Session]:
    """make_workload's requests one at a time, each drawn when it is asked for (the
    same ones, in the same order): a long simulated run holds only the prompts in
    flight, not the whole run's. A file is read whole (a list): its timestamps, if it
    has them, set the arrivals. Workload 'sessions' gives `num` Sessions (sessions.py),
    drawn as `sessions` says, whose turns the drivers send."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    if name == "file":
        if path is None:
            raise ValueError("workload 'file' needs a JSONL path")
        return load_jsonl(path)
    if name == "sessions":
        from pdserve.bench.sessions import SessionShape, iter_sessions
        return iter_sessions(num, random.Random(seed), range(4, vocab_size), scale,
                             sessions or SessionShape())
    return _draw(name, num, random.Random(seed), range(4, vocab_size), scale, input_len,
                 output_len, range_ratio, prefix_share, prefix_len)


def _draw(name: str, num: int, rng: random.Random, ids: range, scale: float, input_len: int,
          output_len: int, range_ratio: float, prefix_share: float,
          prefix_len: int) -> Iterator[BenchRequest]:
    def tokens(n: int) -> list[int]:
        return rng.choices(ids, k=n)

    if name == "random":
        # vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)].
        def around(n: int) -> int:
            low, high = int(n * (1 - range_ratio) * scale), int(n * (1 + range_ratio) * scale)
            return max(1, rng.randint(max(1, low), max(1, high)))
        for _ in range(num):
            yield BenchRequest(tokens(around(input_len)), around(output_len))
    elif name in PROFILES:
        inp, out = PROFILES[name]
        for _ in range(num):
            yield BenchRequest(tokens(inp.sample(rng, scale)), out.sample(rng, scale))
    elif name == "prefix-shared":
        groups = [tokens(max(1, int(prefix_len * scale))) for _ in range(4)]
        for _ in range(num):
            suffix = tokens(max(1, int(input_len * scale)))
            prefix = rng.choice(groups) if rng.random() < prefix_share else []
            yield BenchRequest(prefix + suffix, max(1, int(output_len * scale)))
    else:
        yield from conversations(num, rng, tokens, scale)


# Multi-turn chat, shaped so that about 37% of all prompt blocks were seen before (the
# share measured in Mooncake's conversation trace; `seen_block_share` measures a
# run's: a median of 37% over 150 requests at scale 0.5 across seeds, 31% at scale
# 0.25, less in short runs as all 16 conversations start fresh). A conversation's
# next prompt is its last prompt, the reply to it, and a new message. Replies are
# random tokens, not what the model said, so only the last prompt can be a hit.
_FIRST_MESSAGE = LengthDist(600, 2400, 4096)
_NEXT_MESSAGE = LengthDist(300, 1600, 4096)
_REPLY = LengthDist(40, 400, 1024)  # prompts outweigh replies ~20:1 (Mooncake's: ~35:1)
_MEAN_TURNS = 1.7  # turns per conversation: 1 + geometric (59% are one turn)
_LIVE_CONVERSATIONS = 16


def conversations(num: int, rng: random.Random, tokens, scale: float) -> Iterator[BenchRequest]:
    """`num` turns of interleaved conversations: _LIVE_CONVERSATIONS go on at once and
    each request is the next turn of one of them, drawn at random, so a conversation's
    turns are about that many requests apart (its last turn has usually finished)."""
    def new():
        return {"prompt": tokens(_FIRST_MESSAGE.sample(rng, scale)),
                "turns": 1 + geometric(rng, 1 / _MEAN_TURNS)}

    context = max(2, int(_FIRST_MESSAGE.maximum * scale))  # prompt and reply, at most
    live = [new() for _ in range(_LIVE_CONVERSATIONS)]
    for _ in range(num):
        i = rng.randrange(len(live))
        conv = live[i]
        prompt = conv["prompt"][:context - 1]
        reply = min(_REPLY.sample(rng, scale), context - len(prompt))
        yield BenchRequest(prompt, reply)
        conv["turns"] -= 1
        conv["prompt"] = prompt + tokens(reply) + tokens(_NEXT_MESSAGE.sample(rng, scale))
        if conv["turns"] <= 0 or len(conv["prompt"]) >= context:
            live[i] = new()  # it ended, or its next turn would not fit the context


def geometric(rng: random.Random, p: float) -> int:
    """Failures before the first success, each try succeeding with probability p."""
    n = 0
    while rng.random() >= p:
        n += 1
    return n


def seen_block_share(requests: list[BenchRequest], block_size: int) -> float:
    """The share of the workload's prompt blocks a prefix cache could hit (token-id
    prompts; the blocks the router's prefix index looks up) whose whole prefix an
    earlier prompt held: the most any prefix cache could hit."""
    seen: set[bytes] = set()
    total = hit = 0
    for req in requests:
        for key in block_hashes(list(req.prompt), block_size):  # chained: names the prefix
            total += 1
            hit += key in seen
            seen.add(key)
    return hit / total if total else 0.0


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
