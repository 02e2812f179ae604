"""The TPOT budgets of the requests a decode worker runs for this router, kept in
arrays as the requests change (one joins, leaves, or is sent tokens), so that a
decision reads a worker's budgets in a few array operations however many requests
run there. Rebuilding them from the requests was a Python loop over every request
of each worker a decision read, on every decision once tokens had flowed since.
Pure: the time is given."""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from pdserve.router.policy.cluster_state import NO_BUDGETS, TpotBudgets


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


_FIELDS = (("priority", np.int64), ("tpot", np.float64), ("max_tokens", np.int64),
           ("first", np.float64), ("done", np.int64), ("live", np.bool_))


class BudgetRows:
    """One row per request with a TPOT SLO, in the order they joined (rows of those
    that left are dropped now and then, the order kept). A request counts from
    when it joins: by when it must have generated all it expects (the mean over
    its output; it expects max_tokens), or before its first token, how long it may
    take once that comes; and how many tokens it has left."""

    def __init__(self, capacity: int = 8) -> None:
        self._row: dict[int, int] = {}  # id(request) -> its row
        self._requests: list[Running | None] = []  # row -> request (None: it left)
        self._pending: set[int] = set()  # rows without a first token yet
        self._n = 0  # rows in use, those of requests that left included
        for name, dtype in _FIELDS:
            setattr(self, f"_{name}", np.zeros(capacity, dtype=dtype))
        # _count() as the last read left it; None: a request joined, left or was
        # sent tokens since
        self._counted: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return len(self._row)

    def join(self, request: Running) -> None:
        tpot = request.tpot_slo_s
        if tpot is None or id(request) in self._row:
            return
        if self._n == len(self._live):
            self._compact()
        i, first = self._n, request.first_token_at
        self._n += 1
        self._priority[i], self._tpot[i] = int64_priority(request.priority), tpot
        self._max_tokens[i], self._done[i] = request.max_tokens, request.num_output_tokens
        self._first[i], self._live[i] = math.nan if first is None else first, True
        if first is None:
            self._pending.add(i)
        self._row[id(request)] = i
        self._requests.append(request)
        self._counted = None

    def leave(self, request: Running) -> None:
        i = self._row.pop(id(request), None)
        if i is None:
            return
        self._live[i], self._requests[i] = False, None
        self._pending.discard(i)
        self._counted = None
        if self._n - len(self._row) > max(len(self._row), 16):  # more left than stay
            self._compact()

    def progressed(self, request: Running) -> None:
        """It was sent tokens (its first among them, perhaps)."""
        i = self._row.get(id(request))
        if i is not None:
            self._done[i] = request.num_output_tokens
            self._counted = None
            if i in self._pending:
                self._first_came(i)

    def at(self, now: float) -> TpotBudgets:
        """How long each remaining step may take from `now` (wall clock) on."""
        for i in list(self._pending):
            self._first_came(i)
        if self._counted is None:
            self._counted = self._count()
        priority, deadline, remaining, allowed = self._counted
        if not len(remaining):
            return NO_BUDGETS
        allowance = (deadline - now) / remaining
        waiting = np.isnan(deadline)  # no first token: its whole allowance ahead
        if not waiting.any():
            return TpotBudgets(priority=priority, remaining=remaining, allowance_s=allowance)
        allowance[waiting] = allowed[waiting] / remaining[waiting]
        return TpotBudgets(priority=priority, remaining=remaining, allowance_s=allowance,
                           waiting=waiting)

    def _count(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(priority, deadline, remaining, allowed) of the live requests: allowed is
        the time its output may take after its first token, and deadline when that
        ends (NaN before its first token). Only priority may be a view (a slice of
        its column, when every row is live): a row's priority is written once, when
        it joins, past the rows counted here, and compacting makes new columns. The
        others are new arrays."""
        n = self._n
        live = self._live[:n]
        take = slice(0, n) if live.all() else np.flatnonzero(live)
        done, first = self._done[take], self._first[take]
        total = np.maximum(self._max_tokens[take], done + 1)
        allowed = self._tpot[take] * (total - 1)
        # Before its first token it will decode all its tokens but that one.
        remaining = np.maximum(total - np.where(np.isnan(first), np.maximum(done, 1), done), 1)
        return self._priority[take], first + allowed, remaining, allowed

    def _first_came(self, i: int) -> None:
        first = self._requests[i].first_token_at
        if first is not None:
            self._first[i] = first
            self._pending.discard(i)
            self._counted = None

    def _compact(self) -> None:
        """Drops the rows of requests that left, in order, with room for as many more."""
        keep = np.flatnonzero(self._live[:self._n])
        capacity = max(2 * len(keep), 8)
        for name, dtype in _FIELDS:
            column = np.zeros(capacity, dtype=dtype)
            column[:len(keep)] = getattr(self, f"_{name}")[keep]
            setattr(self, f"_{name}", column)
        self._requests = [self._requests[i] for i in keep]
        self._row = {id(r): i for i, r in enumerate(self._requests)}
        self._pending = {i for i in range(len(keep)) if math.isnan(self._first[i])}
        self._n = len(keep)


_INT64 = (-(1 << 63), (1 << 63) - 1)


def int64_priority(priority: int) -> int:
    """A request's priority as the int64 arrays hold it: any integer is accepted
    (SamplingParams leaves it unbounded), one past 64 bits ranks as the bound."""
    return min(max(priority, _INT64[0]), _INT64[1])
