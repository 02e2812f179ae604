"""The router's view of one worker: its Ray actor handle, its role, the load this
router counts itself, the telemetry the worker last reported, and the pump that
reads the worker's step stream (deltas of this router's requests, fanned out to
per-request queues, and telemetry). A worker whose process died is out of service
(alive False) until the router has it back (Router._revive) or evicts it.

The policy reads a WorkerState snapshot of each handle; it is rebuilt only after a
field it shows changed, so a snapshot of many workers costs little per request."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.latency_calibration import NONE, Calibration
from pdserve.engine.latency_model import StepCost
from pdserve.engine.worker_messages import WorkerTelemetry
from pdserve.router.cluster_state import HasRole, WorkerState
from pdserve.router.errors import WorkerError, WorkerStalled, short_reason

log = logging.getLogger(__name__)

# Fields a WorkerState shows: setting one drops the cached state.
_SHOWN = frozenset({"role", "alive", "draining", "queued", "queued_tokens", "inflight",
                    "telemetry", "num_blocks", "step_cost", "prompt_share",
                    "calibration"})


@dataclass(eq=False)
class WorkerHandle(HasRole):
    worker_id: str
    actor: object  # WorkerActor handle
    role: str  # prefill | decode | both
    address: str = ""  # its kv_transfer rendezvous, which prefill workers pair with
    num_blocks: int = 0
    alive: bool = True  # in service: not dead, not restarting
    draining: bool = False  # takes no new requests (drain, role change, removal)
    # Counted by this router: prompts sent to be computed here and not yet computed
    # (prefill jobs, and colocated requests before their first token), and their
    # tokens; requests reserved or running here.
    queued: int = 0
    queued_tokens: int = 0
    inflight: int = 0
    telemetry: WorkerTelemetry | None = None  # the last report
    heard_at: float = float("-inf")  # time.monotonic() when it arrived
    step_cost: StepCost | None = None  # its latency model as fitted from its reports
    prompt_share: float = 0.0  # of its recent time, spent computing prompts
    calibration: Calibration = NONE  # how far its forecasts ran from measurements
    # request id -> its TokenDeltas (or the error that ends it)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    pump: asyncio.Task | None = None
    # Called with each report (the router's metrics and latency models).
    # (worker, report, the report before it)
    on_report: Callable[["WorkerHandle", WorkerTelemetry, WorkerTelemetry | None], None] \
        | None = None
    _state: WorkerState | None = field(default=None, repr=False)
    _drained: asyncio.Event | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in _SHOWN:
            object.__setattr__(self, "_state", None)
            if self._drained is not None and self.queued == 0 and self.inflight == 0:
                self._drained.set()

    def drain(self) -> asyncio.Event:
        """Takes no new requests from now; the event is set once this router has none
        on it (at once if it has none now)."""
        self._drained = asyncio.Event()
        self.draining = True
        return self._drained

    def state(self) -> WorkerState:
        if self._state is None:
            self._state = WorkerState(self.worker_id, self.role, self.alive, self.draining,
                                      self.queued, self.queued_tokens, self.inflight,
                                      self.telemetry, self.heard_at,
                                      self.telemetry.num_blocks if self.telemetry
                                      else self.num_blocks, self.step_cost,
                                      prompt_share=self.prompt_share,
                                      calibration=self.calibration)
        return self._state

    def enqueue(self, num_tokens: int) -> None:
        self.queued += 1
        self.queued_tokens += num_tokens

    def unqueue(self, num_tokens: int) -> None:
        self.queued -= 1
        self.queued_tokens -= num_tokens

    def heard(self, telemetry: WorkerTelemetry) -> None:
        previous = self.telemetry
        self.telemetry, self.heard_at = telemetry, time.monotonic()
        if self.on_report is not None:
            self.on_report(self, telemetry, previous)

    def start_pump(self, stall_timeout_s: float,
                   on_death: Callable[["WorkerHandle"], None] = lambda worker: None,
                   subscriber: str = "",
                   on_stall: Callable[["WorkerHandle"], None] = lambda worker: None) -> None:
        """Subscribes to this router's batches (`subscriber` names it), replacing an
        earlier subscription (a revived worker's). on_stall hears when the worker goes
        silent past the bound, and when it reports again (`alive` says which)."""
        self.stop_pump()
        self.alive = True
        self.pump = asyncio.get_running_loop().create_task(
            self._pump(stall_timeout_s, on_death, subscriber, on_stall))

    def stop_pump(self) -> None:
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()

    async def _pump(self, stall_timeout_s: float,
                    on_death: Callable[["WorkerHandle"], None], subscriber: str,
                    on_stall: Callable[["WorkerHandle"], None]) -> None:
        """The worker sends a batch every step and telemetry while idle (only while its
        engine loop makes progress), so no item within the bound means it stalled:
        every request on it fails then, with a typed error, it leaves service until it
        reports again, and the wait goes on. A stream that ends with an error (the
        process or its engine loop died) fails them too, and on_death hears of it."""
        steps = self.actor.steps.remote(stall_timeout_s, subscriber)
        pending = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(steps.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=stall_timeout_s)
                if not done:
                    if self.alive:
                        log.error("worker %s made no step within %gs", self.worker_id,
                                  stall_timeout_s)
                        self.alive = False
                        on_stall(self)
                    self._fail_all(WorkerStalled(f"worker {self.worker_id} made no "
                                                 f"step within {stall_timeout_s:g}s"))
                    continue
                ref, pending = pending.result(), None
                batch = await ref
                if not self.alive:  # it went silent, and reports again
                    log.warning("worker %s reports again", self.worker_id)
                    self.alive = True
                    on_stall(self)
                if batch.telemetry is not None:
                    self.heard(batch.telemetry)
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
            log.error("worker %s stream ended: %s", self.worker_id, short_reason(exc))
            self._fail_all(WorkerError(f"worker {self.worker_id} failed: "
                                       f"{short_reason(exc)}"))
            on_death(self)

    def _fail_all(self, error: Exception) -> None:
        for queue in list(self.streams.values()):
            queue.put_nowait(error)
