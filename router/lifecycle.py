"""One request's life in the router, as an explicit state.

    ACCEPTED -> RESERVING -> RESERVED -> PREFILLING -> STARTING -> STREAMING -> DONE
    ACCEPTED -> SUBMITTING -> STREAMING -> DONE                          (colocated)

What each phase holds on the workers, and so what `release` must free:

    ACCEPTED    nothing
    RESERVING   maybe a reservation on `decode`: the answer is in flight (the worker
                refuses a reservation for an id it was told to abort)
    RESERVED    blocks and an expected transfer on `decode`
    PREFILLING  that, plus a prefill job on `prefill` (computing, then sending KV)
    STARTING    landed KV on `decode`, joining its batch
    SUBMITTING / STREAMING   a request running on `decode`
    DONE        nothing: the decode worker finished it

Whatever ends a request (finish, error, client cancel, deadline, worker death), the
router releases its Flight exactly once; the release aborts the request on the
workers its phase names and on nobody else."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field, replace
from typing import Awaitable

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.slo import Slo
from pdserve.worker.messages import Job


class Phase(enum.Enum):
    ACCEPTED = "accepted"
    RESERVING = "reserving"
    RESERVED = "reserved"
    PREFILLING = "prefilling"
    STARTING = "starting"
    SUBMITTING = "submitting"
    STREAMING = "streaming"
    DONE = "done"


_HOLDS_DECODE = {Phase.RESERVING, Phase.RESERVED, Phase.PREFILLING, Phase.STARTING,
                 Phase.SUBMITTING, Phase.STREAMING}


@dataclass(frozen=True)
class Accepted:
    """What the router knows once a request is validated."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    owner: str = ""  # who may abort it (auth.owner)
    slo: Slo = Slo()  # its own, over the server's defaults


@dataclass(eq=False)
class Flight:
    req: Accepted
    phase: Phase = Phase.ACCEPTED
    decode: object | None = None  # the WorkerHandle it is reserved / running on
    prefill: object | None = None  # the WorkerHandle computing its KV
    # request id's TokenDeltas from the decode worker's pump (or the error ending it)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # Router.abort
    starting: asyncio.Future | None = None  # the decode worker's start call
    released: bool = False
    # Colocated: the worker whose prefill queue counts its prompt (this many tokens)
    # until its first token there.
    queued_on: object | None = None
    queued_tokens: int = 0
    predicted: object | None = None  # the Decision it was placed by (its forecasts)
    placed_at: float | None = None  # wall clock of that decision
    # monotonic clock when it began to wait for capacity (None: it never waited); a
    # decode worker's refusal sends it back to placement, but its waits add up.
    waited_since: float | None = None
    first_token_at: float | None = None  # wall clock of token #1
    # What its client has: every token streamed, and their text's length (a move to
    # another worker goes on from exactly there: Job.output_token_ids, text_sent).
    output_token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0
    # Prompt tokens a prefill worker's prefix cache served: its usage's cached tokens
    # when its KV was sent (the decode worker's own count does not see them).
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0  # of those, from its host tier
    migrations: int = 0  # times it moved off a failed worker
    failure: str = ""  # why it last moved
    # The id its workers know it by: its own, and after each move (replay, or live) a
    # new one, since the worker it left may hold the old id until its abort lands
    # there (a client's id is printable: never one of these). `moves` numbers them.
    key: str = ""
    moves: int = 0
    # Live migration (live_move.py): set when its source's last delta (marked paused)
    # came through the source's step stream, after every token the source made.
    paused: asyncio.Event | None = None
    # worker id -> the generation it failed on: not chosen again while that process
    # lives, if another worker can take the request
    failed_on: dict[str, str] = field(default_factory=dict)
    # SamplingParams.n > 1. The leader (choice 0, the request itself) is placed and
    # prefilled; its other choices (`choices`, each a Flight of its own, `index` i)
    # fork from it on its worker at its first token, sharing its prompt's KV, and are
    # held where it is until then (keyed request.choice_id(its key, i)). A choice
    # waits on `forked` (resolved with its first delta, if the router makes it, and
    # how much of its text the worker repeats); from there it streams, and moves, as
    # a request of its own.
    choices: list["Flight"] = field(default_factory=list)
    index: int = 0
    forked: asyncio.Future | None = None

    def __post_init__(self) -> None:
        self.key = self.key or self.req.request_id

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def new_key(self) -> str:
        """An id for the request on the worker it moves to (`key` once it runs there)."""
        self.moves += 1
        return f"{self.req.request_id}\x1fmoved-{self.moves}"

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def unforked(self) -> list["Flight"]:
        """Its choices still waiting for its first token (n > 1), their streams open."""
        return [c for c in self.choices if not c.forked.done() and not c.released]

    @property
    def forks(self) -> bool:
        """Its first token, when it comes, forks its choices (n > 1)."""
        return bool(self.choices) and not self.output_token_ids

    @property
    def moved(self) -> Accepted:
        """The request as another worker would take it now: its prompt and the tokens
        generated so far, with what remains of max_tokens."""
        req, outputs = self.req, self.output_token_ids
        return replace(req, prompt_token_ids=req.prompt_token_ids + outputs,
                       params=replace(req.params, max_tokens=req.params.max_tokens
                                      - len(outputs)))

    # What its TPOT budget reads (snapshot.Running).
    @property
    def priority(self) -> int:
        return self.req.params.priority

    @property
    def tpot_slo_s(self) -> float | None:
        return self.req.slo.tpot_s

    @property
    def max_tokens(self) -> int:
        return self.req.params.max_tokens

    def job(self, key: str | None = None) -> Job:
        """The request as a worker runs it, under `key` (default: its key now): its
        prompt, and the tokens made so far as its outputs (their text sent)."""
        req = self.req
        return Job(request_id=key or self.key, prompt_token_ids=req.prompt_token_ids,
                   sampling_params=req.params, arrival_time=req.arrival_time,
                   output_token_ids=tuple(self.output_token_ids), text_sent=self.text_sent,
                   ttft_slo_s=req.slo.ttft_s)

    def flush(self) -> None:
        """Drops what its queue holds from a worker it no longer runs on (an abort's
        Cancelled stays)."""
        kept = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Cancelled):
                kept.append(item)
        for item in kept:
            self.queue.put_nowait(item)

    def holders(self) -> list:
        """The workers holding something of this request now, to abort on release."""
        held = [self.decode] if self.phase in _HOLDS_DECODE and self.decode else []
        if self.phase is Phase.PREFILLING and self.prefill is not None:
            held.append(self.prefill)
        return held


class Cancelled(Exception):
    """Router.abort asked this request to end."""


async def until(flight: Flight, call: Awaitable, timeout_s: float):
    """Awaits `call` (a worker call, a wait), bounded by timeout_s (TimeoutError) and
    by Router.abort of the request (Cancelled)."""
    task = asyncio.ensure_future(call)
    cancel = asyncio.ensure_future(flight.cancelled.wait())
    try:
        await asyncio.wait({task, cancel}, timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        cancel.cancel()
        if not task.done():
            task.cancel()
    if flight.cancelled.is_set():
        raise Cancelled
    if not task.done() or task.cancelled():
        raise asyncio.TimeoutError
    return task.result()
