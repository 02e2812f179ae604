"""What the routing policy sees: an immutable snapshot of every worker, and the
request being placed. Plain data, no I/O: `decide` is a function of these alone, so
it is tested without Ray and reused by the capacity simulator."""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")  # both: takes whole requests (colocated)


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    role: str
    alive: bool = True  # in service (not dead, not restarting)
    # Counted by this router: requests sent and not yet answered (prefill role), or
    # reserved + running (decode and both roles), and their prompt tokens.
    queued: int = 0
    queued_tokens: int = 0
    inflight: int = 0
    # As the worker last reported; None = unknown (never reported, or too old).
    free_blocks: int | None = None
    num_blocks: int = 0

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class ClusterState:
    workers: tuple[WorkerState, ...]
    # Prompt tokens admitted to one prefill worker and not yet prefilled beyond which
    # a request is refused (0 = unbounded), so nothing admitted outwaits its lease.
    max_queued_prefill_tokens: int = 0
    retry_after_s: float = 1.0

    def by_role(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class RequestView:
    """What placing a request needs to know of it."""
    num_prompt_tokens: int
    blocks_needed: int  # KV blocks its prompt and first token take on the decode side
    # Workers that refused this request already (no room when asked): not asked again.
    refused: frozenset[str] = frozenset()
