"""The decode worker as a Ray async actor. `steps(subscriber)` streams, to each
subscriber (a router), one StepBatch per engine step with the deltas of that
subscriber's requests only: a request belongs to the subscriber that reserved or
submitted it, so several routers can share one pool. A step error its engine cannot
pin on requests ends the process, and Ray restarts the actor (launch sets
max_restarts)."""
from __future__ import annotations

import asyncio
import time

import ray

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import exit_for_restart
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker_messages import Reservation, StepBatch
from pdserve.kv_transfer import TransferConfig


@ray.remote
class DecodeWorkerActor:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        self._loop = asyncio.get_event_loop()
        self._subscribers: dict[str, asyncio.Queue[StepBatch]] = {}
        self._owners: dict[str, str] = {}  # request id -> its subscriber
        self.worker = DecodeWorker(worker_id, engine_config, transfer, on_batch=self._publish,
                                   on_death=exit_for_restart,
                                   kv_host=ray.util.get_node_ip_address())

    def _publish(self, batch: StepBatch) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._route, batch)

    def _route(self, batch: StepBatch) -> None:
        """Each delta to its request's subscriber; a finished request is forgotten. A
        delta nobody listens for (its router is gone) is dropped."""
        by_subscriber: dict[str, list] = {}
        for delta in batch.deltas:
            owner = (self._owners.pop(delta.request_id, None) if delta.finished
                     else self._owners.get(delta.request_id))
            if owner in self._subscribers:
                by_subscriber.setdefault(owner, []).append(delta)
        for owner, deltas in by_subscriber.items():
            self._subscribers[owner].put_nowait(StepBatch(batch.worker_id, deltas))

    async def _owned(self, request_id: str, subscriber: str, start):
        """Runs start() (which may start a request) with the request owned by
        `subscriber` from before its first delta can be published; ownership is
        dropped if nothing started. An id another subscriber's request holds is
        refused before anything is called: it is theirs."""
        if request_id in self._owners:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use "
                                      "on this worker")
        self._owners[request_id] = subscriber
        try:
            return await start()
        except BaseException:
            self._owners.pop(request_id, None)
            raise

    async def address(self) -> str:
        return self.worker.address

    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, arrival_time: float,
                      subscriber: str = "") -> Reservation | None:
        reservation = await self._owned(request_id, subscriber, lambda: asyncio.wrap_future(
            self.worker.reserve(request_id, prompt_token_ids, params, arrival_time)))
        if reservation is None:
            self._owners.pop(request_id, None)
        return reservation

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, arrival_time: float,
                     subscriber: str = "") -> None:
        await self._owned(request_id, subscriber, lambda: asyncio.wrap_future(
            self.worker.submit(request_id, prompt_token_ids, params, arrival_time)))

    async def start(self, request_id: str, first_token: int) -> None:
        await asyncio.wrap_future(self.worker.start(request_id, first_token))

    async def abort(self, request_id: str, subscriber: str = "") -> None:
        """Another subscriber's request of the same id is not this caller's to end."""
        owner = self._owners.get(request_id)
        if owner is not None and owner != subscriber:
            return
        # It waits for the engine's state lock: not on this loop, which streams steps.
        await asyncio.to_thread(self.worker.abort, request_id)

    async def steps(self, stall_timeout_s: float, subscriber: str = ""):
        """Every step's new tokens of this subscriber's requests, for as long as it
        listens (a subscriber that calls again replaces its earlier stream). Steps
        that queued up while the subscriber was busy go out merged, as one batch.
        While idle, an empty batch every quarter of the subscriber's stall bound says
        the engine loop is alive; a loop that died, or made no progress within the
        bound, ends the stream with an error instead."""
        loop = self.worker.loop
        batches = self._subscribers[subscriber] = asyncio.Queue()
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(batches.get(), stall_timeout_s / 4)
                except asyncio.TimeoutError:
                    if loop.error is not None:
                        raise RuntimeError(f"engine loop stopped: {loop.error!r}") from None
                    if time.monotonic() - loop.progress_at > stall_timeout_s:
                        continue  # no heartbeat: the subscriber declares this worker stalled
                    batch = StepBatch(self.worker.worker_id, [])
                while not batches.empty():
                    batch = batch.merged(batches.get_nowait())
                yield batch
        finally:
            if self._subscribers.get(subscriber) is batches:
                del self._subscribers[subscriber]

    async def stats(self) -> dict:
        return self.worker.stats()

    async def shutdown(self) -> None:
        self.worker.shutdown()
