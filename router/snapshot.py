"""The snapshot the policy decides on: every worker's state as the router holds it,
the pairs' transfer costs, and the TPOT budgets of the router's requests running on
each worker. Pure but for a memo the caller keeps: a function of what it is given."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pdserve.engine.latency_model import TransferCost
from pdserve.router.cluster_state import NO_BUDGETS, ClusterState, TpotBudgets, WorkerState
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.worker_columns import ColumnsMemo


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


class Held(Protocol):
    """A decode worker's requests, as the router holds them (a WorkerHandle)."""
    @property
    def version(self) -> int: ...  # changes whenever a request there joins, leaves or
    # is sent tokens
    @property
    def flights(self) -> Mapping[str, Running]: ...


def snapshot(workers: tuple[WorkerState, ...], held: Mapping[str, Held], now: float,
             wall_now: float, config: RouterConfig, model: ModelInfo,
             transfer: Mapping[tuple[str, str], TransferCost],
             deadlines: MutableMapping[Held, "Deadlines"] | None = None,
             columns: ColumnsMemo | None = None) -> ClusterState:
    """now: the router's monotonic clock; wall_now: its wall clock (running requests'
    first tokens are wall times). held: decode worker id -> its requests. deadlines:
    a memo of each worker's deadlines the caller keeps across snapshots (each entry
    is rebuilt once its worker's version changes; weak keys let left workers go).
    columns: the workers' columns as the caller's last snapshot left them (only the
    rows of workers whose state changed since are read again)."""
    return ClusterState(workers=workers, now=now, config=config, model=model,
                        transfer=transfer,
                        budgets=Budgets(held, wall_now, {} if deadlines is None else deadlines),
                        columns_memo=columns)


@dataclass(frozen=True, eq=False)
class Deadlines:
    """The TPOT SLOs of a worker's running requests as one version of it holds them:
    by when each must have generated all it expects (the mean over its output; it
    expects max_tokens), and how many tokens it has left. A budget at any moment
    follows from these; requests without a TPOT SLO or a first token are left out."""
    version: int
    priority: np.ndarray
    deadline: np.ndarray  # wall clock
    remaining: np.ndarray

    @classmethod
    def of(cls, held: Held) -> "Deadlines":
        priority, deadline, remaining = [], [], []
        for request in held.flights.values():
            tpot, first = request.tpot_slo_s, request.first_token_at
            if tpot is None or first is None:
                continue
            n = request.num_output_tokens
            total = max(request.max_tokens, n + 1)
            priority.append(request.priority)
            deadline.append(first + tpot * (total - 1))
            remaining.append(total - n)
        return cls(version=held.version, priority=np.array(priority, dtype=np.int64),
                   deadline=np.array(deadline, dtype=np.float64),
                   remaining=np.array(remaining, dtype=np.int64))

    def at(self, now: float) -> TpotBudgets:
        """How long each remaining step may take from `now` (wall clock) on."""
        if not len(self.remaining):
            return NO_BUDGETS
        return TpotBudgets(priority=self.priority, remaining=self.remaining,
                           allowance_s=(self.deadline - now) / self.remaining)


class Budgets(Mapping):
    """decode worker id -> budgets of the requests running there, each worker's
    computed when a decision first reads it (a decision reads a few candidates, and
    a large cluster runs many requests), from its deadlines as memoized until its
    version changes (between two of its steps, only the clock moves)."""

    def __init__(self, held: Mapping[str, Held], now: float,
                 deadlines: MutableMapping[Held, Deadlines]):
        self._held, self._now, self._deadlines = held, now, deadlines
        self._computed: dict[str, TpotBudgets] = {}

    def __getitem__(self, worker_id: str) -> TpotBudgets:
        found = self._computed.get(worker_id)
        if found is None:
            held = self._held[worker_id]  # KeyError: no such worker
            memo = self._deadlines.get(held)
            if memo is None or memo.version != held.version:
                memo = self._deadlines[held] = Deadlines.of(held)
            found = self._computed[worker_id] = memo.at(self._now)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
