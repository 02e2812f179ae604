"""The one seam between the router and a worker: every call the router makes to a
worker goes through a WorkerClient. Two implementations: `RayWorkerClient` (a
worker actor on Ray: production) and `pdserve.sim.SimWorker` (a worker in virtual
time: the simulator and router tests). Placement, admission, the wait for capacity,
supervision and the planner are the same code over either.

Errors: a call the worker's process could not answer (it died, or is restarting)
raises router.errors.WorkerDied; an error the worker raised (InvalidRequestError,
RequestFailedError, kv_transfer's typed errors, a wrong role) reaches the caller as
raised there. The router bounds every call with its own timeout."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from pdserve.worker.messages import (
    BlockCopy,
    IncomingCopy,
    Job,
    Paused,
    PrefillJob,
    PrefillResult,
    Reservation,
    StepBatch,
    WorkerStats,
)


class WorkerClient(Protocol):
    async def address(self) -> str:
        """Its KV rendezvous, which prefill-capable workers pair with."""

    async def connect(self, receiver_addresses: list[str]) -> None:
        """Pairs it (a worker that prefills for others) with these decode workers now,
        rather than on their first request."""

    async def disconnect(self, receiver_addresses: list[str]) -> None:
        """Closes its pairs with these decode workers (they left, restarted or stopped
        decoding): connections, process groups and threads, on both sides."""

    async def reserve(self, job: Job, subscriber: str) -> Reservation | None:
        """Decode side: KV blocks held for the prompt, which a prefill worker sends;
        None when it has no room. The request belongs to `subscriber` (a router)."""

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        """Computes the prompt, streams its KV to job.target and samples token #1;
        returns once the decode side confirmed the KV."""

    async def start(self, request_id: str, first_token: int, choices: list[int] = ()) -> None:
        """Decode side: the KV landed; the request joins the batch after token #1.
        choices: n > 1, the first tokens of choices 1 .. n-1 (PrefillResult's), which
        fork from it there, sharing its blocks."""

    async def submit(self, job: Job, subscriber: str) -> None:
        """Role both: the whole request runs here."""

    # Live migration (decode_worker/moves.py, router/live_move.py): a running request's
    # KV copied from a source to a target, both decode-capable.

    async def take_over(self, job: Job, subscriber: str) -> Reservation | None:
        """Target: blocks for the request as it stands (Job.output_token_ids), its own
        prefix hits counted; no transfer expected yet. None when it has no room."""

    async def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        """Target: the request grows by the tokens its source made since, and a copy of
        its computed blocks from incoming.first_block on is coming (final: all of them;
        it decodes on once that landed). Returns the blocks the copy goes into."""

    async def send_blocks(self, copy: BlockCopy) -> int:
        """Source: sends blocks of the request (running; or paused, for the final copy);
        returns the bytes sent once they landed."""

    async def pause(self, request_id: str) -> Paused | None:
        """Source: the request leaves the batch at the next step boundary, its KV kept;
        its last delta here (marked paused) follows its tokens. None: not running."""

    async def abort(self, request_id: str, subscriber: str) -> None:
        """Frees whatever `subscriber`'s request of that id holds here."""

    async def abort_all(self, subscriber: str) -> int:
        """That router is gone: every request of `subscriber` here ends (its KV freed)
        and its stream is forgotten. Returns how many requests it ended."""

    def steps(self, stall_timeout_s: float, subscriber: str) -> AsyncIterator[StepBatch]:
        """One StepBatch per engine step (merged when the reader fell behind): the
        deltas of `subscriber`'s requests and the worker's telemetry, which it also
        sends while idle as long as its engine makes progress. Ends with an error if
        the worker or its engine loop died. A second call replaces the first."""

    async def set_role(self, role: str) -> None:
        """prefill | decode | both; refused while it holds requests."""

    async def stats(self) -> WorkerStats:
        ...

    def kill(self) -> None:
        """Ends the worker for good (no restart); one already gone is fine."""
