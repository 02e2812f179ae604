"""Agentic sessions (`--workload sessions`): multi-turn conversations whose turns
depend on each other.

A session is a first message (a system prompt, tools, a task), then turns that each
send the whole history: the last prompt, the reply it got and a new message (a tool's
output, or the user's next words). Sessions start at the run's arrivals; turn k+1 is
sent only once turn k has ended and a think (or tool) time has passed (`play`), so the
history's blocks may still be in a prefix cache when it comes. A session ends after
its drawn number of turns, before a turn that would not fit the context, or at its
first turn that did not complete (failed, or refused for overload).

The reply in the history is the one the server returned (its token ids): the blocks
the worker computed. A server that returns no token ids (an OpenAI server that
ignores `return_token_ids`) gets random tokens of the length asked for in their
place, which no cache holds.

Each session draws from generators of its own, seeded when it is drawn, so its turns
are the same whichever sessions run beside it and whenever its replies come.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest, LengthDist, geometric

_FIRST_MESSAGE = LengthDist(2000, 8000, 16384)
_NEXT_MESSAGE = LengthDist(400, 4000, 8192)
_REPLY = LengthDist(150, 1000, 2048)
_CONTEXT = 32768  # a turn's prompt and reply at most, before --scale and the model's
MAX_TURNS = 64


@dataclass(frozen=True)
class SessionShape:
    """What sessions are drawn from (--session-turns, --think-time); --scale shrinks
    the lengths and the context alike."""
    mean_turns: float = 6.0  # 1 + geometric, at most MAX_TURNS
    think_s: float = 2.0  # mean seconds from a turn's end to the next one's send (exponential)
    max_model_len: int | None = None  # the model's context, where it is known

    def __post_init__(self) -> None:
        if not 1 <= self.mean_turns <= MAX_TURNS:
            raise ValueError(f"mean turns per session must be in [1, {MAX_TURNS}]")
        if self.think_s < 0:
            raise ValueError("think time must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def context(self, scale: float) -> int:
        """The most tokens a turn's prompt and reply may hold together."""
        ceiling = max(2, int(_CONTEXT * scale))
        return ceiling if self.max_model_len is None else min(ceiling, self.max_model_len)


def iter_sessions(num: int, rng: random.Random, ids: range, scale: float,
                  shape: SessionShape) -> Iterator[Session]:
    for number in range(num):
        yield Session(number, rng.getrandbits(64), ids, scale, shape)


class Session:
    """One session's turns, each drawn once the reply to the one before is known."""

    def __init__(self, number: int, seed: int, ids: range, scale: float, shape: SessionShape):
        self.number = number
        self._draw = random.Random(seed)
        self._filler = random.Random(seed + 1)  # replies a server did not return
        self._ids, self._scale, self._think_s = ids, scale, shape.think_s
        self._context = shape.context(scale)
        self.num_turns = min(MAX_TURNS, 1 + geometric(self._draw, 1 / shape.mean_turns))
        self.turns_sent = 0
        self._last: BenchRequest | None = None

    def first_turn(self) -> BenchRequest:
        asked = min(_REPLY.sample(self._draw, self._scale), self._context - 1)
        length = min(_FIRST_MESSAGE.sample(self._draw, self._scale), self._context - asked)
        return self._turn(self._tokens(self._draw, length), asked)

    def next_turn(self, reply: list[int]) -> tuple[float, BenchRequest] | None:
        """After the last turn's reply (its token ids; empty: the server sent none), the
        think time and the next turn; None when the session is over."""
        assert self._last is not None, "first_turn comes first"
        if self.turns_sent >= self.num_turns:
            return None
        think_s = self._draw.expovariate(1 / self._think_s) if self._think_s else 0.0
        message = self._tokens(self._draw, _NEXT_MESSAGE.sample(self._draw, self._scale))
        asked = _REPLY.sample(self._draw, self._scale)
        reply = reply or self._tokens(self._filler, self._last.max_tokens)
        history = len(self._last.prompt) + len(reply)
        if history + len(message) + asked > self._context:
            return None  # the next prompt would not fit
        return think_s, self._turn(list(self._last.prompt) + reply + message, asked)

    def _turn(self, prompt: list[int], asked: int) -> BenchRequest:
        self.turns_sent += 1
        self._last = BenchRequest(prompt, asked, session=self.number, turn=self.turns_sent)
        return self._last

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self._ids, k=n)


# send(turn, reply): the turn's record once it ended, its output token ids put in reply
Send = Callable[[BenchRequest, list[int]], Awaitable[RequestRecord]]


async def play(session: Session, send: Send) -> None:
    """Sends the session's turns in order, each once the one before has ended and its
    think time has passed (a virtual loop's sleep in the simulator); it ends at its
    first turn that did not complete. Each send keeps its own timeout."""
    turn = session.first_turn()
    while True:
        reply: list[int] = []
        if not (await send(turn, reply)).ok:
            return
        following = session.next_turn(reply)
        if following is None:
            return
        think_s, turn = following
        await asyncio.sleep(think_s)
