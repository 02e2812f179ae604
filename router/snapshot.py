"""The snapshot the policy decides on: every worker's state as the router holds it,
the pairs' transfer costs, and the TPOT budgets of the router's requests running on
each worker. Pure: a function of what it is given."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from pdserve.engine.latency_model import TransferCost
from pdserve.router.cluster_state import ClusterState, TpotBudget, WorkerState
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo


class Running(Protocol):
    """A request running on a decode worker, as its TPOT budget reads it (a Flight)."""
    @property
    def priority(self) -> int: ...
    @property
    def tpot_slo_s(self) -> float | None: ...
    @property
    def first_token_at(self) -> float | None: ...  # wall clock; None before token #1
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


def snapshot(workers: tuple[WorkerState, ...], running: Mapping[str, Mapping[str, Running]],
             now: float, wall_now: float, config: RouterConfig, model: ModelInfo,
             transfer: Mapping[tuple[str, str], TransferCost]) -> ClusterState:
    """now: the router's monotonic clock; wall_now: its wall clock (running requests'
    first tokens are wall times). running: decode worker id -> its requests there."""
    return ClusterState(workers=workers, now=now, config=config, model=model,
                        transfer=transfer, budgets=Budgets(running, wall_now))


def budget(request: Running, now: float) -> TpotBudget | None:
    """How long each of the request's remaining steps may take and still meet its TPOT
    SLO (the mean over its output; it expects max_tokens); None when it has no TPOT
    SLO or no first token yet."""
    tpot, first = request.tpot_slo_s, request.first_token_at
    if tpot is None or first is None:
        return None
    n = request.num_output_tokens
    total = max(request.max_tokens, n + 1)
    remaining = total - n
    deadline = first + tpot * (total - 1)
    return TpotBudget(priority=request.priority, allowance_s=(deadline - now) / remaining,
                      remaining=remaining)


class Budgets(Mapping):
    """decode worker id -> budgets of the requests running there, each worker's
    computed when a decision first reads it: a decision reads a few candidates, and
    a large cluster runs many requests."""

    def __init__(self, running: Mapping[str, Mapping[str, Running]], now: float):
        self._running, self._now = running, now
        self._computed: dict[str, tuple[TpotBudget, ...]] = {}

    def __getitem__(self, worker_id: str) -> tuple[TpotBudget, ...]:
        found = self._computed.get(worker_id)
        if found is None:
            now, found = self._now, []
            for request in self._running[worker_id].values():  # KeyError: no such worker
                b = budget(request, now)
                if b is not None:
                    found.append(b)
            found = self._computed[worker_id] = tuple(found)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._running)

    def __len__(self) -> int:
        return len(self._running)
