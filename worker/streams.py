"""A worker's step streams, one per subscriber (a router), kept alike by the Ray actor
(actor.py) and the simulator's SimWorker: each stream carries the subscriber's own
requests' deltas (worker/core.py routes them) and the worker's telemetry, which every
subscriber gets. Batches that queued while a subscriber was busy go out merged, as
one; a subscriber that calls again replaces its earlier stream; an error put on the
streams ends every one of them."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.worker.messages import StepBatch, TokenDelta, WorkerTelemetry


@dataclass
class _Subscriber:
    batches: asyncio.Queue  # of StepBatch, or an exception that ends the stream
    stall_timeout_s: float  # its bound on the worker's silence


class Streams:
    """On one event loop: every method runs on it."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._subscribers: dict[str, _Subscriber] = {}

    def __bool__(self) -> bool:
        return bool(self._subscribers)

    def publish(self, routed: dict[str | None, list[TokenDelta]],
                telemetry: WorkerTelemetry | None) -> None:
        """Each subscriber's deltas (`routed`: WorkerCore.route's) and the telemetry;
        a subscriber with neither gets nothing."""
        for name, subscriber in self._subscribers.items():
            deltas = routed.get(name, [])
            if deltas or telemetry is not None:
                subscriber.batches.put_nowait(StepBatch(
                    worker_id=self.worker_id, deltas=deltas, telemetry=telemetry))

    def report_idle(self, telemetry: WorkerTelemetry, quiet_s: float) -> None:
        """Telemetry while no step reports it, to the subscribers whose stall bound the
        worker's last progress (`quiet_s` ago) is within."""
        for subscriber in self._subscribers.values():
            if quiet_s <= subscriber.stall_timeout_s:
                subscriber.batches.put_nowait(StepBatch(
                    worker_id=self.worker_id, deltas=[], telemetry=telemetry))

    def end(self, error: Exception) -> None:
        """Every stream ends with `error` (the worker died)."""
        for subscriber in self._subscribers.values():
            subscriber.batches.put_nowait(error)

    def drop(self, subscriber: str) -> None:
        """The subscriber is gone: its stream is forgotten."""
        self._subscribers.pop(subscriber, None)

    async def stream(self, subscriber: str, stall_timeout_s: float, *,
                     poll_s: float | None = None,
                     check: Callable[[], None] | None = None) -> AsyncIterator[StepBatch]:
        """The subscriber's batches for as long as it listens. poll_s: how often, while
        nothing comes, check() runs (it raises to end the stream)."""
        me = self._subscribers[subscriber] = _Subscriber(asyncio.Queue(), stall_timeout_s)
        batches = me.batches
        try:
            while True:
                if poll_s is None:
                    batch = await batches.get()
                else:
                    try:
                        batch = await asyncio.wait_for(batches.get(), poll_s)
                    except asyncio.TimeoutError:
                        batch = None
                    if batch is None:  # check() outside the except: its error stands alone
                        if check is not None:
                            check()
                        continue
                while isinstance(batch, StepBatch) and not batches.empty():
                    later = batches.get_nowait()
                    batch = later if isinstance(later, Exception) else batch.merged(later)
                if isinstance(batch, Exception):
                    raise batch
                yield batch
        finally:
            if self._subscribers.get(subscriber) is me:
                del self._subscribers[subscriber]
