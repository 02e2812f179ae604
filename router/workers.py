"""The router's view of its workers: Ray actor handles plus the load the router
counts itself, and one pump per decode worker that fans its StepBatch stream out to
per-request queues."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve.router.errors import WorkerError
from pdserve.router.policy import DecodeLoad, PrefillLoad

log = logging.getLogger(__name__)


@dataclass
class PrefillHandle:
    worker_id: str
    actor: object  # PrefillWorkerActor handle
    queued: int = 0

    def load(self) -> PrefillLoad:
        return PrefillLoad(self.worker_id, self.queued)


@dataclass
class DecodeHandle:
    worker_id: str
    actor: object  # DecodeWorkerActor handle
    num_blocks: int
    free_blocks: int
    inflight: int = 0
    # request id -> its TokenDeltas (or the WorkerError that ends it)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    pump: asyncio.Task | None = None

    def load(self) -> DecodeLoad:
        return DecodeLoad(self.worker_id, self.inflight, self.free_blocks, self.num_blocks)

    def start_pump(self) -> None:
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for ref in self.actor.steps.remote():
                batch = await ref
                for delta in batch.deltas:
                    queue = self.streams.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker died: every request on it fails
            log.error("decode worker %s stream ended: %s", self.worker_id, exc)
            for queue in list(self.streams.values()):
                queue.put_nowait(WorkerError(f"decode worker {self.worker_id} failed: {exc}"))
