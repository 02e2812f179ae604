"""The workers of a snapshot as columns: what a decision scans on every worker, in
arrays, so a cluster of a thousand workers is shortlisted by numpy rather than by a
Python loop over it. Each row is read from its worker's state; a state the router
kept since the last snapshot keeps its row (`WorkerColumns.of(..., previous)`), so
only the workers that reported since are read again. Pure."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState

# Rows read again one by one up to this share of the workers; past it, all at once.
_PATCH_SHARE = 0.25
# Workers forecast at most per side: beyond it, those a rough estimate puts first.
_SHORTLIST = 16


def _row(w: WorkerState, adaptive: bool) -> tuple:
    available = w.available
    return (available and w.decodes, available and w.sends_kv(adaptive), w.all_queued,
            w.all_queued_tokens, *w.rough())


_DTYPES = (np.bool_, np.bool_, np.int64, np.int64, np.float64, np.float64, np.int64)


@dataclass(frozen=True, eq=False)
class WorkerColumns:
    """Row i is states[i]."""
    states: tuple[WorkerState, ...]
    adaptive: bool
    decodes: np.ndarray  # available, and decodes (role decode or both)
    sends_kv: np.ndarray  # available, and prefills for others (WorkerState.sends_kv)
    queued: np.ndarray  # prompts queued there, every replica's count
    queued_tokens: np.ndarray  # and their tokens
    rough_decode_s: np.ndarray  # WorkerState.rough(), its three parts
    per_token_s: np.ndarray
    reported_queued_tokens: np.ndarray
    index: dict[str, int]  # worker id -> its row

    @classmethod
    def of(cls, states: tuple[WorkerState, ...], adaptive: bool,
           previous: "WorkerColumns | None" = None) -> "WorkerColumns":
        """The columns of these states; rows of states that `previous` (the last
        snapshot's, of the same workers in the same order) already read are kept."""
        if (previous is not None and previous.adaptive == adaptive
                and len(previous.states) == len(states)):
            changed = np.flatnonzero(np.fromiter(map(operator.is_not, states, previous.states),
                                                 dtype=np.bool_, count=len(states))).tolist()
            if len(changed) <= _PATCH_SHARE * len(states):
                return previous._patched(states, changed)
        rows = [_row(w, adaptive) for w in states]
        columns = [np.array(c, dtype=t) for c, t in zip(zip(*rows), _DTYPES)] if rows \
            else [np.empty(0, dtype=t) for t in _DTYPES]
        return cls(states, adaptive, *columns, index=_index(states))

    def _patched(self, states: tuple[WorkerState, ...], changed: list[int]) -> "WorkerColumns":
        if not changed:  # the same states: the same rows
            return self
        columns = [c.copy() for c in self._columns]
        for i in changed:
            for column, value in zip(columns, _row(states[i], self.adaptive)):
                column[i] = value
        same_rows = all(states[i].worker_id == self.states[i].worker_id for i in changed)
        return WorkerColumns(states, self.adaptive, *columns,
                             index=self.index if same_rows else _index(states))

    @property
    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.decodes, self.sends_kv, self.queued, self.queued_tokens,
                self.rough_decode_s, self.per_token_s, self.reported_queued_tokens)

    def rows(self, worker_ids: Iterable[str]) -> np.ndarray:
        """The rows of these workers (ids of no worker here are left out)."""
        index = self.index
        return np.array([index[w] for w in worker_ids if w in index], dtype=np.int64)

    def spread(self, by_worker: Mapping[str, int]) -> np.ndarray:
        """worker id -> a count, as a column (0 for the workers it leaves out)."""
        out, index = np.zeros(len(self.states), dtype=np.int64), self.index
        for worker_id, value in by_worker.items():
            i = index.get(worker_id)
            if i is not None:
                out[i] = value
        return out


def _index(states: tuple[WorkerState, ...]) -> dict[str, int]:
    return {w.worker_id: i for i, w in enumerate(states)}


class ColumnsMemo:
    """The last snapshot's columns, which the next one starts from (a router keeps one,
    as it keeps its requests' deadlines)."""

    def __init__(self) -> None:
        self.last: WorkerColumns | None = None

    def of(self, states: tuple[WorkerState, ...], adaptive: bool) -> WorkerColumns:
        self.last = WorkerColumns.of(states, adaptive, self.last)
        return self.last


def columns_of(state: ClusterState) -> WorkerColumns:
    """The snapshot's workers as columns (from its memo's last, if it has one)."""
    memo = state.columns_memo or ColumnsMemo()
    return memo.of(state.workers, state.adaptive)


def shortlist(rows: np.ndarray, key: np.ndarray, n: int) -> np.ndarray:
    """Rows in their order when n or fewer; else the n with the smallest key, smallest
    first (ties in row order: heapq.nsmallest's order)."""
    if len(rows) <= n:
        return rows
    return rows[np.argsort(key, kind="stable")[:n]]


def shortlists(request: RequestView, state: ClusterState) -> tuple[list[WorkerState],
                                                                     list[WorkerState]]:
    """The workers forecast as decode sides, and as prefill sides: every available one
    that may take the request (a decode side: not one that refused it; a prefill
    side: one whose prompt queue has room, `least_loaded.has_room`). Past _SHORTLIST
    on a side, a rough estimate (`WorkerState.rough`, as last reported, read into the
    router's columns once per state) picks the ones forecast, least first: a
    decoder's step and queued prompt work, a prefill side's queue and this prompt's
    uncached tokens at its per-token cost. Their forecasts read staleness as usual.
    Every worker is scanned in arrays: a cluster may have a thousand."""
    n, cached = request.num_prompt_tokens, request.cached_tokens
    cols = columns_of(state)
    decodes = cols.decodes
    if request.refused:
        decodes = decodes.copy()
        decodes[cols.rows(request.refused)] = False
    limit = state.max_queued_prefill_tokens
    sends = cols.sends_kv if not limit else cols.sends_kv & (
        (cols.queued == 0) | (cols.queued_tokens + n <= limit))
    decode_rows = np.flatnonzero(decodes)
    decode_rows = shortlist(decode_rows, cols.rough_decode_s[decode_rows], _SHORTLIST)
    prefill_rows = np.flatnonzero(sends)
    if len(prefill_rows) > _SHORTLIST:
        tokens = cols.reported_queued_tokens + n
        if cached:
            tokens -= cols.spread(cached)
        prefill_rows = shortlist(prefill_rows,
                                 cols.per_token_s[prefill_rows] * tokens[prefill_rows],
                                 _SHORTLIST)
    return [cols.states[i] for i in decode_rows], [cols.states[i] for i in prefill_rows]
