"""The router's view of its workers: Ray actor handles plus the load the router
counts itself, and one pump per decode worker that fans its StepBatch stream out to
per-request queues. A worker whose process died is out of service (alive False) until
the router has it back (Router._revive)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from pdserve.router.cluster_state import WorkerState
from pdserve.router.errors import WorkerError, WorkerStalled, short_reason

log = logging.getLogger(__name__)


@dataclass
class PrefillHandle:
    worker_id: str
    actor: object  # PrefillWorkerActor handle
    queued: int = 0  # prefills admitted and not yet answered
    queued_tokens: int = 0
    alive: bool = True

    def state(self) -> WorkerState:
        return WorkerState(self.worker_id, "prefill", self.alive, self.queued,
                           self.queued_tokens)

    def enqueue(self, num_tokens: int) -> None:
        self.queued += 1
        self.queued_tokens += num_tokens

    def unqueue(self, num_tokens: int) -> None:
        self.queued -= 1
        self.queued_tokens -= num_tokens


@dataclass
class DecodeHandle:
    worker_id: str
    actor: object  # DecodeWorkerActor handle
    num_blocks: int
    free_blocks: int
    address: str = ""  # its kv_transfer rendezvous, which prefill workers pair with
    role: str = "decode"  # or "both": takes whole requests (colocated)
    inflight: int = 0
    alive: bool = True  # false once its step stream ended with an error
    # request id -> its TokenDeltas (or the error that ends it)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    pump: asyncio.Task | None = None

    def state(self) -> WorkerState:
        return WorkerState(self.worker_id, self.role, self.alive, inflight=self.inflight,
                           free_blocks=self.free_blocks, num_blocks=self.num_blocks)

    def start_pump(self, stall_timeout_s: float,
                   on_death: Callable[["DecodeHandle"], None] = lambda worker: None,
                   subscriber: str = "") -> None:
        """Subscribes to the deltas of this router's requests (`subscriber` names it),
        replacing an earlier subscription (a revived worker's)."""
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
        self.alive = True
        self.pump = asyncio.get_running_loop().create_task(
            self._pump(stall_timeout_s, on_death, subscriber))

    async def _pump(self, stall_timeout_s: float,
                    on_death: Callable[["DecodeHandle"], None], subscriber: str) -> None:
        """The worker sends a batch every step and a heartbeat while idle (only while
        its engine loop makes progress), so no item within the bound means it stalled:
        every request on it fails then, with a typed error, and the wait goes on. A
        stream that ends with an error (the process or its engine loop died) fails them
        too, and on_death hears of it."""
        steps = self.actor.steps.remote(stall_timeout_s, subscriber)
        pending = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(steps.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=stall_timeout_s)
                if not done:
                    self._fail_all(WorkerStalled(f"decode worker {self.worker_id} made no "
                                                 f"step within {stall_timeout_s:g}s"))
                    continue
                ref, pending = pending.result(), None
                batch = await ref
                for delta in batch.deltas:
                    queue = self.streams.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
        except asyncio.CancelledError:
            if pending is not None:
                pending.cancel()
            raise
        except Exception as exc:  # the worker died, or its engine loop did
            if self.pump is not asyncio.current_task():
                return  # a stream replaced since: its end is old news
            self.alive = False
            log.error("decode worker %s stream ended: %s", self.worker_id, short_reason(exc))
            self._fail_all(WorkerError(f"decode worker {self.worker_id} failed: "
                                       f"{short_reason(exc)}"))
            on_death(self)

    def _fail_all(self, error: Exception) -> None:
        for queue in list(self.streams.values()):
            queue.put_nowait(error)
