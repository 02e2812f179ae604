"""The snapshot the policy decides on: every worker's state as the router holds it,
the pairs' transfer costs, and the TPOT budgets of the router's requests running on
each worker (as its handle keeps them: budget_rows.py). Pure: a function of what
it is given."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from pdserve.engine.latency_model import TransferCost
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.budget_rows import BudgetRows
from pdserve.router.policy.cluster_state import ClusterState, TpotBudgets, WorkerState
from pdserve.router.policy.worker_columns import ColumnsMemo


class Held(Protocol):
    """A decode worker's requests, as the router holds them (a WorkerHandle)."""
    @property
    def budget_rows(self) -> BudgetRows: ...


def snapshot(workers: tuple[WorkerState, ...], held: Mapping[str, Held], now: float,
             wall_now: float, config: RouterConfig, model: ModelInfo,
             transfer: Mapping[tuple[str, str], TransferCost],
             columns: ColumnsMemo | None = None) -> ClusterState:
    """now: the router's monotonic clock; wall_now: its wall clock (running requests'
    first tokens are wall times). held: decode worker id -> its requests. columns:
    the workers' columns as the caller's last snapshot left them (only the rows of
    workers whose state changed since are read again)."""
    return ClusterState(workers=workers, now=now, config=config, model=model,
                        transfer=transfer, budgets=Budgets(held, wall_now),
                        columns_memo=columns)


class Budgets(Mapping):
    """decode worker id -> budgets of the requests running there, each worker's
    computed when a decision first reads it (a decision reads a few candidates, and
    a large cluster runs many requests), from the rows its handle keeps."""

    def __init__(self, held: Mapping[str, Held], now: float):
        self._held, self._now = held, now
        self._computed: dict[str, TpotBudgets] = {}

    def __getitem__(self, worker_id: str) -> TpotBudgets:
        found = self._computed.get(worker_id)
        if found is None:
            rows = self._held[worker_id].budget_rows  # KeyError: no such worker
            found = self._computed[worker_id] = rows.at(self._now)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
