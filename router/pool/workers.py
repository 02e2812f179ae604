"""The router's handle on one worker: its WorkerClient, the WorkerState the policy
reads (replaced, never mutated, on every change), this router's requests on it, and
the pump that reads its step stream (deltas of this router's requests, fanned out to
their flights, and telemetry). A worker whose process died is out of service (its
state's `alive` False) until the pool has it back or evicts it."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from pdserve.engine.request import parent_of
from pdserve.router.errors import WorkerDied, WorkerStalled, short_reason
from pdserve.router.policy.budget_rows import BudgetRows
from pdserve.router.policy.cluster_state import WorkerState
from pdserve.router.pool.worker_client import WorkerClient
from pdserve.worker.messages import WorkerTelemetry

log = logging.getLogger(__name__)


# slots: a decision reads every worker's state through its handle, and at a thousand
# workers that read is a cache miss per handle and object (the __dict__ was one more:
# 230-256 -> 118-167 us for 1,000 handles with cold caches, here).
@dataclass(eq=False, slots=True)
class WorkerHandle:
    client: WorkerClient
    state: WorkerState
    address: str = ""  # its kv_transfer rendezvous, which prefill workers pair with
    locator: str = ""  # how another router replica reaches it (pool_registry.WorkerEntry)
    generation: str = ""  # its process's incarnation (WorkerStats.incarnation)
    # request id (Flight.key) -> this router's request held here (reserved, starting
    # or running): its flight (lifecycle.Flight), whose queue the pump feeds.
    flights: dict[str, object] = field(default_factory=dict)
    # Those of them whose prompt is queued here (placed whole, no first token yet):
    # counted queued, not in flight, so the load counts each once.
    prompting: set[str] = field(default_factory=set)
    # the TPOT budgets of its flights, kept as they join, leave and are sent tokens
    budget_rows: BudgetRows = field(default_factory=BudgetRows)
    # When it last began serving in its role (joined, came back, changed role), on
    # the loop's clock: its first reports after it are a cold start.
    serving_since: float = 0.0
    pump: asyncio.Task | None = None
    _orphans: set[str] = field(default_factory=set, repr=False)  # choice keys aborted
    _drained: asyncio.Event | None = field(default=None, repr=False)

    @classmethod
    def of(cls, worker_id: str, client: WorkerClient, role: str, num_blocks: int = 0,
           address: str = "", locator: str = "", generation: str = "") -> "WorkerHandle":
        return cls(client=client, address=address, locator=locator, generation=generation,
                   state=WorkerState(worker_id=worker_id, role=role, num_blocks=num_blocks))

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def update(self, **changes) -> None:
        """A new state with these fields changed."""
        self.state = state = replace(self.state, **changes)
        if self._drained is not None and state.queued == 0 and state.inflight == 0:
            self._drained.set()

    def drain(self) -> asyncio.Event:
        """Takes no new requests from now; the event is set once this router has none
        on it (at once if it has none now)."""
        self._drained = asyncio.Event()
        self.update(draining=True)
        return self._drained

    def enqueue(self, num_tokens: int, flight=None) -> None:
        """A prompt sent to be computed here (until its first token); `flight` when
        the request runs here whole (it is held here too)."""
        if flight is not None:
            self.prompting.add(flight.key)
        s = self.state
        self.update(queued=s.queued + 1, queued_tokens=s.queued_tokens + num_tokens)

    def unqueue(self, num_tokens: int, flight=None) -> None:
        """The prompt's first token came (or the request ended): a request held here
        decodes here now."""
        s, decoding = self.state, 0
        if flight is not None and flight.key in self.prompting:
            self.prompting.discard(flight.key)
            decoding = flight.key in self.flights
        self.update(queued=s.queued - 1, queued_tokens=s.queued_tokens - num_tokens,
                    inflight=s.inflight + decoding)

    def hold(self, flight) -> None:
        """The request is reserved, submitted or running here (in flight here once
        past its prompt, if that is queued here)."""
        self.flights[flight.key] = flight
        self.budget_rows.join(flight)
        if flight.key not in self.prompting:
            self.update(inflight=self.state.inflight + 1)

    def unhold(self, flight) -> None:
        self.flights.pop(flight.key, None)
        self.budget_rows.leave(flight)
        if flight.key not in self.prompting:
            self.update(inflight=self.state.inflight - 1)

    def progressed(self, flight) -> None:
        """A flight here was sent tokens (its TPOT budget moved)."""
        self.budget_rows.progressed(flight)

    def start_pump(self, stall_timeout_s: float, subscriber: str,
                   on_report: Callable[["WorkerHandle", WorkerTelemetry], None],
                   on_death: Callable[["WorkerHandle"], None],
                   on_stall: Callable[["WorkerHandle"], None],
                   silent_after_s: float = float("inf")) -> None:
        """Subscribes to `subscriber`'s batches, replacing an earlier subscription (a
        revived worker's). on_report hears each telemetry report; on_stall hears when
        the worker goes silent (no batch for silent_after_s: it takes no new requests),
        when it stalls (none for stall_timeout_s: its requests fail), and when it
        reports again (its state's `silent` and `alive` say which); on_death when its
        stream ends with an error."""
        self.stop_pump()
        self.update(alive=True, silent=False)
        self.pump = asyncio.get_running_loop().create_task(
            self._pump(stall_timeout_s, subscriber, on_report, on_death, on_stall,
                       silent_after_s))

    def stop_pump(self) -> None:
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()

    async def _pump(self, stall_timeout_s: float, subscriber: str, on_report, on_death,
                    on_stall, silent_after_s: float) -> None:
        """The worker sends a batch every step and telemetry while idle (only while its
        engine loop makes progress), so no item within the bound means it stalled:
        every request on it fails then, with a typed error, it leaves service until it
        reports again, and the wait goes on. A stream that ends with an error (the
        process or its engine loop died) fails them too, and on_death hears of it."""
        steps = aiter(self.client.steps(stall_timeout_s, subscriber))
        pending = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(steps))
                silence = not self.state.silent and silent_after_s < stall_timeout_s
                wait_s = (silent_after_s if silence
                          else stall_timeout_s - silent_after_s if self.state.alive
                          and self.state.silent else stall_timeout_s)
                done, _ = await asyncio.wait({pending}, timeout=wait_s)
                if not done and silence:
                    log.warning("worker %s sent nothing for %gs: no new requests until "
                                "it does", self.worker_id, silent_after_s)
                    self.update(silent=True)
                    on_stall(self)
                    continue
                if not done:
                    if self.state.alive:
                        log.error("worker %s made no step within %gs", self.worker_id,
                                  stall_timeout_s)
                        self.update(alive=False)
                        on_stall(self)
                    self._fail_all(WorkerStalled(f"worker {self.worker_id} made no "
                                                 f"step within {stall_timeout_s:g}s"))
                    continue
                batch, pending = pending.result(), None
                if not self.state.alive or self.state.silent:  # it reports again
                    log.warning("worker %s reports again", self.worker_id)
                    self.update(alive=True, silent=False)
                    on_stall(self)
                if batch.telemetry is not None:
                    on_report(self, batch.telemetry)
                for delta in batch.deltas:
                    flight = self.flights.get(delta.request_id)
                    if flight is None:
                        if parent_of(delta.request_id) is not None:
                            self._orphan(delta, subscriber, stall_timeout_s)
                        continue
                    if not delta.paused:
                        flight.queue.put_nowait(delta)
                        continue
                    if delta.token_ids or delta.text:  # merged with its last tokens
                        flight.queue.put_nowait(replace(delta, paused=False))
                    if flight.paused is not None:  # a live move waits for it
                        flight.paused.set()
        except asyncio.CancelledError:
            if pending is not None:
                pending.cancel()
            raise
        except Exception as exc:  # the worker died, its engine loop did, or its stream ended
            if self.pump is not asyncio.current_task():
                return  # a stream replaced since: its end is old news
            self.update(alive=False)
            reason = "its step stream ended" if isinstance(exc, StopAsyncIteration) \
                else short_reason(exc)
            log.error("worker %s stream ended: %s", self.worker_id, reason)
            self._fail_all(WorkerDied(f"worker {self.worker_id} failed: {reason}"))
            on_death(self)

    def _orphan(self, delta, subscriber: str, timeout_s: float) -> None:
        """A choice (n > 1) forked on the worker after its request ended here (an abort
        that landed a step too late): nobody reads it, so it is aborted (once)."""
        key = delta.request_id
        if delta.finished:
            self._orphans.discard(key)
        elif key not in self._orphans:
            self._orphans.add(key)
            task = asyncio.ensure_future(asyncio.wait_for(
                self.client.abort(key, subscriber), timeout_s))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _fail_all(self, error: Exception) -> None:
        for flight in list(self.flights.values()):
            flight.queue.put_nowait(error)
