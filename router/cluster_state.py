"""What the routing policy sees: an immutable snapshot of every worker, and the
request being placed. Plain data, no I/O, no clock read: `decide` is a function of
these alone, so it is tested without Ray and reused by the capacity simulator."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.worker_messages import WorkerTelemetry


class HasRole:
    """What a worker's `role` lets it do (shared by WorkerState and the router's
    WorkerHandle)."""
    role: str

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class WorkerState(HasRole):
    worker_id: str
    role: str  # prefill | decode | both (engine.worker_messages.ROLES)
    alive: bool = True  # in service (not dead, not restarting, not stalled)
    draining: bool = False  # takes no new requests
    # Counted by this router: prefill jobs sent and not yet answered, and their
    # prompt tokens; requests reserved or running here (decode and both roles).
    queued: int = 0
    queued_tokens: int = 0
    inflight: int = 0
    telemetry: WorkerTelemetry | None = None  # the worker's last report
    heard_at: float = float("-inf")  # when it arrived (the router's monotonic clock)
    num_blocks: int = 0

    @property
    def available(self) -> bool:
        """Whether it may be given a new request."""
        return self.alive and not self.draining


@dataclass(frozen=True)
class ClusterState:
    workers: tuple[WorkerState, ...]
    now: float = 0.0  # the router's monotonic clock when the snapshot was taken
    # A report older than this is unknown: never read as "full" or as "free".
    stale_after_s: float = 5.0
    # Prompt tokens admitted to one prefill worker and not yet prefilled beyond which
    # a request is refused (0 = unbounded), so nothing admitted outwaits its lease.
    max_queued_prefill_tokens: int = 0
    retry_after_s: float = 1.0

    def report(self, worker: WorkerState) -> WorkerTelemetry | None:
        """The worker's telemetry if fresh, else None (unknown)."""
        if worker.telemetry is None or self.now - worker.heard_at > self.stale_after_s:
            return None
        return worker.telemetry

    def free_blocks(self, worker: WorkerState) -> int | None:
        report = self.report(worker)
        return None if report is None else report.free_blocks


@dataclass(frozen=True)
class RequestView:
    """What placing a request needs to know of it."""
    num_prompt_tokens: int
    blocks_needed: int  # KV blocks its prompt and first token take on the decode side
    # Workers that refused this request already (no room when asked): not asked again.
    refused: frozenset[str] = frozenset()
