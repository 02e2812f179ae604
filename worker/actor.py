"""A worker as a Ray async actor (resources set with .options()).

`steps(subscriber)` streams, to each subscriber (a router), one StepBatch per engine
step: the deltas of that subscriber's requests only (a request belongs to the
subscriber that reserved or submitted it, so several routers share one pool) and the
worker's telemetry, which every subscriber gets. While no step runs, a telemetry
report goes out at least every IDLE_REPORT_INTERVAL_S, as long as the engine loop makes
progress: silence past a subscriber's bound means the worker stalled. A step error
its engine cannot pin on requests ends the process, and Ray restarts the actor
(launch sets max_restarts).

With tensor_parallel_size N > 1 the actor is rank 0: it starts ranks 1..N-1
(worker/ranks.py) in the placement group it was placed in (bundles 1..N-1; the
spawner makes one per worker) or, placed in none, in one of its own. A rank that is
lost ends this process too, at once: the worker leaves service whole, its requests
are replayed elsewhere, and Ray restarts it with a new group (the old ranks, owned
by this process, end with it)."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from contextlib import aclosing
from dataclasses import replace

import ray

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import exit_for_restart
from pdserve.engine.request import parent_of
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.telemetry import IDLE_REPORT_INTERVAL_S
from pdserve.kv_transfer import TransferConfig
from pdserve.worker.messages import (
    BlockCopy,
    IncomingCopy,
    Job,
    Paused,
    PrefillJob,
    PrefillResult,
    Reservation,
    StepBatch,
)
from pdserve.worker.streams import Streams
from pdserve.worker.worker import Worker

log = logging.getLogger(__name__)


@ray.remote
class WorkerActor:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig,
                 role: str = "decode", orphan_after_s: float = 0.0,
                 rank_resources: dict[str, float] | None = None):
        """orphan_after_s > 0: the worker ends itself after that long with no call to
        `stats` (the routers of a shared pool call it every third of the registry's TTL):
        a detached worker whose every router replica is gone, which nothing else would
        ever end. (A subscriber's stream is no sign of life: Ray does not tell a
        generator that its reader died.) rank_resources: what each of its other
        tensor-parallel ranks holds of its bundle (num_cpus, num_gpus)."""
        self._loop = asyncio.get_event_loop()
        self._published_at = time.monotonic()
        self._ticker: asyncio.Task | None = None
        self._asked_at = time.monotonic()  # the last call to stats
        self._stopping = False
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted actor makes a new one
        self.ranks = None
        group, links = None, ()
        if engine_config.tensor_parallel_size > 1:
            from pdserve.worker.ranks import start_ranks
            placement = ray.util.get_current_placement_group()
            self.ranks = start_ranks(engine_config, placement, kv=(worker_id, transfer),
                                     resources=rank_resources)
            engine_config = replace(engine_config, device=self.ranks.device)
            group, links = self.ranks.group, tuple(self.ranks.links)
        try:
            self.worker = Worker(worker_id, engine_config, transfer, role,
                                 on_batch=self._publish, on_death=exit_for_restart,
                                 kv_host=ray.util.get_node_ip_address(), tp_group=group,
                                 rank_links=links)
        except BaseException:
            if self.ranks is not None:
                self.ranks.shutdown()
            raise
        if self.ranks is not None:
            threading.Thread(target=self._watch_ranks, daemon=True,
                             name="tp-ranks-watch").start()
        self.core = self.worker.core  # ownership: read and written on this loop only
        self.streams = Streams(worker_id)  # the subscribers' step streams, on this loop
        if orphan_after_s > 0:
            self._loop.call_soon_threadsafe(
                lambda: self._loop.create_task(self._reap_if_orphaned(orphan_after_s)))

    def _watch_ranks(self) -> None:
        """A rank lost (its process died, its step failed) ends this worker at once."""
        lost = self.ranks.lost(timeout_s=None)
        if lost and not self._stopping:
            exit_for_restart(RuntimeError(
                f"tensor-parallel rank(s) {lost} of worker {self.worker.worker_id} lost"))

    async def _reap_if_orphaned(self, after_s: float) -> None:
        while True:
            await asyncio.sleep(min(after_s / 4, IDLE_REPORT_INTERVAL_S))  # a bound's check
            if time.monotonic() - self._asked_at > after_s:
                log.warning("worker %s: no router asked for %gs; it ends",
                            self.worker.worker_id, after_s)
                self._shutdown()
                placement = ray.util.get_current_placement_group()
                if placement is not None:  # detached like this worker: nothing else ends it
                    ray.util.remove_placement_group(placement)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def _publish(self, batch: StepBatch) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._route, batch)

    def _route(self, batch: StepBatch) -> None:
        """Each delta to its request's subscriber, the telemetry to all; a finished
        request is forgotten. A delta nobody listens for (its router is gone) is
        dropped."""
        if batch.telemetry is not None:
            self._published_at = time.monotonic()
        routed = self.core.route(batch.deltas)
        for delta in routed.get(None, ()):  # a choice forked after its request's owner
            if not delta.finished and parent_of(delta.request_id) is not None:  # left
                self._orphaned(delta.request_id)
        self.streams.publish(routed, batch.telemetry)

    def _orphaned(self, request_id: str) -> None:
        """A choice (n > 1) nobody owns (its request was aborted, or its router left,
        as it forked): it ends here, off this loop (abort waits for the state lock)."""
        task = asyncio.ensure_future(asyncio.to_thread(self.worker.abort, request_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _tick(self) -> None:
        """Telemetry while no step reports it, to the subscribers whose stall bound the
        engine loop's last progress is within."""
        loop = self.worker.loop
        while loop.error is None:
            await asyncio.sleep(IDLE_REPORT_INTERVAL_S / 2)
            if time.monotonic() - self._published_at < IDLE_REPORT_INTERVAL_S:
                continue
            telemetry = await asyncio.to_thread(self.worker.telemetry)
            self._published_at = time.monotonic()
            self.streams.report_idle(telemetry, time.monotonic() - loop.progress_at)

    async def _owned(self, request_id: str, subscriber: str, start):
        """Runs start() (which may start a request) with the request owned by
        `subscriber` from before its first delta can be published; ownership is
        dropped if nothing started. An id another subscriber's request holds is
        refused before anything is called: it is theirs."""
        self.core.claim(request_id, subscriber)
        try:
            return await start()
        except BaseException:
            self.core.release(request_id)
            raise

    async def address(self) -> str:
        return self.worker.address

    async def pid(self) -> int:
        return os.getpid()

    async def _prepared(self, params: SamplingParams, call):
        """call() once the job's parameters are prepared (a structured-output grammar
        compiled) in a thread, so neither this event loop nor the engine waits."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.worker.prepare, params)
        return await call()

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        return await self._prepared(job.params, lambda: asyncio.wrap_future(
            self.worker.prefill(job)))

    async def connect(self, receiver_addresses: list[str]) -> None:
        await asyncio.to_thread(self.worker.connect, receiver_addresses)

    async def disconnect(self, receiver_addresses: list[str]) -> None:
        await asyncio.to_thread(self.worker.disconnect, receiver_addresses)

    async def reserve(self, job: Job, subscriber: str = "") -> Reservation | None:
        reservation = await self._owned(job.request_id, subscriber, lambda: self._prepared(
            job.sampling_params, lambda: asyncio.wrap_future(self.worker.reserve(job))))
        if reservation is None:
            self.core.release(job.request_id)
        return reservation

    async def submit(self, job: Job, subscriber: str = "") -> None:
        await self._owned(job.request_id, subscriber, lambda: self._prepared(
            job.sampling_params, lambda: asyncio.wrap_future(self.worker.submit(job))))

    async def start(self, request_id: str, first_token: int, choices: list[int] = ()) -> None:
        await asyncio.wrap_future(self.worker.start(request_id, first_token, choices))

    # ---- live migration (decode_worker/moves.py) ---------------------------------

    async def take_over(self, job: Job, subscriber: str = "") -> Reservation | None:
        reservation = await self._owned(job.request_id, subscriber, lambda: self._prepared(
            job.sampling_params, lambda: asyncio.wrap_future(self.worker.take_over(job))))
        if reservation is None:
            self.core.release(job.request_id)
        return reservation

    async def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        return await asyncio.to_thread(self.worker.expect_copy, incoming)

    async def send_blocks(self, copy: BlockCopy) -> int:
        return await asyncio.wrap_future(
            await asyncio.to_thread(self.worker.send_blocks, copy))

    async def pause(self, request_id: str) -> Paused | None:
        return await asyncio.wrap_future(self.worker.pause(request_id))

    async def abort(self, request_id: str, subscriber: str = "") -> None:
        """Another subscriber's request of the same id is not this caller's to end."""
        if not self.core.may_abort(request_id, subscriber):
            return
        # It waits for the engine's state lock: not on this loop, which streams steps.
        await asyncio.to_thread(self.worker.abort, request_id)

    async def abort_all(self, subscriber: str) -> int:
        """The subscriber (a router) is gone: its requests end, their KV freed, and its
        stream is forgotten (Ray's stream does not tell a producer its reader died)."""
        self.streams.drop(subscriber)
        orphans = self.core.orphans(subscriber)
        for request_id in orphans:
            self.core.release(request_id)
            await asyncio.to_thread(self.worker.abort, request_id)
        return len(orphans)

    async def set_role(self, role: str) -> None:
        await asyncio.to_thread(self.worker.set_role, role)

    async def steps(self, stall_timeout_s: float, subscriber: str = ""):
        """Every step's batch for this subscriber, for as long as it listens (a
        subscriber that calls again replaces its earlier stream). Batches that queued
        up while the subscriber was busy go out merged, as one. A loop that died ends
        the stream with an error."""
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        loop = self.worker.loop

        def check() -> None:  # no report: the subscriber's stall bound decides, unless
            if loop.error is not None:  # the loop is known dead
                raise RuntimeError(f"engine loop stopped: {loop.error!r}")
        async with aclosing(self.streams.stream(subscriber, stall_timeout_s,
                                                poll_s=IDLE_REPORT_INTERVAL_S,
                                                check=check)) as batches:
            async for batch in batches:
                yield batch

    async def stats(self) -> dict:
        self._asked_at = time.monotonic()
        return {**await asyncio.to_thread(self.worker.stats), "incarnation": self.incarnation,
                "rank_pids": list(self.ranks.pids) if self.ranks else []}

    async def placement_group_id(self) -> str:
        """The placement group it was placed in (a tensor-parallel worker's, made by
        the spawner), hex; "" if none: another router replica removes it with the
        worker."""
        placement = ray.util.get_current_placement_group()
        return placement.id.hex() if placement is not None else ""

    async def shutdown(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        """The worker ends; a tensor-parallel one's ranks are told to stop, then
        removed (with the placement group, if it made one)."""
        self._stopping = True
        self.worker.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()

