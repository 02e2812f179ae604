"""How a pool starts workers: the Spawner it is given (launch.WorkerSpawner on Ray,
SimCluster in the simulator), and a worker being added as the pool shows it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from pdserve.router.pool.worker_client import WorkerClient
from pdserve.router.pool.workers import WorkerHandle

# progress(worker_id, state): a worker being started is "pending" (not yet placed)
# or "starting" (placed, loading).
Progress = Callable[[str, str], None]


class Spawner(Protocol):
    """Starts workers: launch.WorkerSpawner on Ray, SimCluster in the simulator."""

    async def __call__(self, role: str, progress: Progress) -> WorkerHandle:
        """A fresh worker of `role`, loaded and ready, not yet paired or subscribed,
        telling its progress."""

    def wanted(self, workers: dict[str, int]) -> None:
        """The pool's workers by role, those being added included, whenever that
        changes: a cluster that adds nodes on demand keeps room for them."""

    async def attach(self, locator: str) -> WorkerClient:
        """A client of a worker another router replica started (WorkerEntry.locator)."""


# Workers that failed to start, kept to be shown (admin list) with their reason.
KEPT_FAILURES = 16


@dataclass
class Joining:
    """A worker being added, not yet a member: "pending" (Ray has not placed it),
    "starting" (loading, then pairing) or "failed" (abandoned; `error` says why)."""
    worker_id: str
    role: str
    state: str
    since: float  # monotonic, when it was asked for
    error: str = ""
