"""What the routing policy sees: an immutable snapshot of every worker, and the
request being placed. Plain data, no I/O, no clock read: `decide` is a function of
these alone, so it is tested without Ray and reused by the capacity simulator."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from pdserve.engine.latency_model import (
    DEFAULT_STEP_COST,
    DEFAULT_TRANSFER_COST,
    StepCost,
    TransferCost,
)
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.latency_calibration import NONE, Calibration
from pdserve.router.policy.latency_forecast import WorkerLoad
from pdserve.router.slo import Slo
from pdserve.worker.messages import WorkerTelemetry

if TYPE_CHECKING:  # it reads WorkerState
    from pdserve.router.policy.worker_columns import ColumnsMemo


@dataclass(frozen=True, eq=False)
class TpotBudgets:
    """The TPOT SLOs of this router's requests placed to decode on one worker, as they
    stand now: one entry per request, in arrays (a worker may run hundreds, and a
    decision reads a dozen workers'). Those still waiting for their first token
    count as if it came now: their whole allowance is ahead."""
    priority: np.ndarray  # each request's; lower runs first
    # How long each of its remaining steps may take and still meet its SLO (on track
    # while it covers its worker's step as the goodput policy expects it).
    allowance_s: np.ndarray
    remaining: np.ndarray  # tokens it may still generate
    # Each request's: no first token yet (not in its worker's batch yet); None: none.
    waiting: np.ndarray | None = None

    @classmethod
    def of(cls, rows: Iterable[tuple[int, float, int]]) -> "TpotBudgets":
        """From (priority, allowance_s, remaining) rows."""
        rows = list(rows)
        return cls(priority=np.array([r[0] for r in rows], dtype=np.int64),
                   allowance_s=np.array([r[1] for r in rows], dtype=np.float64),
                   remaining=np.array([r[2] for r in rows], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.remaining)

    @property
    def num_waiting(self) -> int:
        return 0 if self.waiting is None else int(np.count_nonzero(self.waiting))

    def in_batch(self, values: np.ndarray) -> np.ndarray:
        """Of `values` (one per request), those of the requests in the worker's batch
        now: the ones waiting for their first token left out."""
        return values if self.waiting is None else values[~self.waiting]


NO_BUDGETS = TpotBudgets.of(())


@dataclass(frozen=True)
class WorkerState:
    """One worker as the policy sees it, and as the router holds it: the router
    replaces its worker's state (never mutates it) on every change, so a snapshot of
    many workers is a tuple of the states they hold."""
    worker_id: str
    role: str  # prefill | decode | both (pdserve.worker.messages.ROLES)
    alive: bool = True  # in service (not dead, not restarting, not stalled)
    # No step and no report for telemetry_stale_s (a frozen process, a hung loop): no
    # new requests until it reports again; its running ones wait for the stall bound.
    silent: bool = False
    draining: bool = False  # takes no new requests
    # Counted by this router: prompts sent to be computed here and not yet computed,
    # and their tokens; requests reserved or running here past their prompt (decode
    # and both roles; a request placed here whole counts queued until its first token).
    queued: int = 0
    queued_tokens: int = 0
    inflight: int = 0
    # The same counts by the other router replicas over the worker, summed (with
    # --redis-url: shared_load.py; the latest each shared).
    others_queued: int = 0
    others_queued_tokens: int = 0
    others_inflight: int = 0
    telemetry: WorkerTelemetry | None = None  # the worker's last report
    heard_at: float = float("-inf")  # when it arrived (the router's monotonic clock)
    num_blocks: int = 0
    step_cost: StepCost | None = None  # its latency model (None: nothing fitted yet)
    prompt_share: float = 0.0  # of its recent time, spent computing prompts
    calibration: Calibration = NONE  # how its forecasts are scaled

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    def sends_kv(self, adaptive: bool) -> bool:
        """Whether it prefills for other workers: role prefill, or both in adaptive
        mode (outside it, role both runs whole requests only)."""
        return self.role == "prefill" or (adaptive and self.role == "both")

    @property
    def available(self) -> bool:
        """Whether it may be given a new request."""
        return self.alive and not self.draining and not self.silent

    # Every replica's counts: this router's and the others'.
    @property
    def all_queued(self) -> int:
        return self.queued + self.others_queued

    @property
    def all_queued_tokens(self) -> int:
        return self.queued_tokens + self.others_queued_tokens

    @property
    def all_inflight(self) -> int:
        return self.inflight + self.others_inflight

    def _reported(self) -> tuple[int, int, int, int]:
        """(queued tokens, queued requests, decode sequences, their context) from its
        report, or the replicas' counts where they are higher (requests sent since
        the report)."""
        report, decodes = self.telemetry, self.decodes
        return (max(report.waiting_tokens, self.all_queued_tokens),
                max(report.waiting, self.all_queued),
                max(report.running + report.reserved if decodes else 0, self.all_inflight),
                report.context_tokens if decodes else 0)

    # Computed once per state: the router keeps a worker's state until it changes, so
    # most decisions read these cached.
    @cached_property
    def reported_load(self) -> WorkerLoad:
        """Its load from its report, or the replicas' counts where they are higher
        (requests sent since the report)."""
        if self.telemetry is None:
            return self.counted_load
        queued_tokens, queued, seqs, context = self._reported()
        return WorkerLoad(queued_tokens=queued_tokens, queued_requests=queued,
                          decode_seqs=seqs, decode_context=context,
                          token_budget=self.telemetry.token_budget or WorkerLoad.token_budget,
                          prompt_share=self.prompt_share,
                          max_seqs=self.telemetry.max_num_seqs)

    def rough(self) -> tuple[float, float, int]:
        """What shortlists the workers of a large cluster, as last reported, give or
        take: (its decode step plus its queued prompt work, seconds per prompt token,
        queued prompt tokens). Read once per state into the router's columns
        (worker_columns.py), so it builds no WorkerLoad."""
        cost = self.step_cost or DEFAULT_STEP_COST
        if self.telemetry is None:
            queued_tokens, seqs, context = self.all_queued_tokens, self.all_inflight, 0
        else:
            queued_tokens, _, seqs, context = self._reported()
        return (cost.base_s + cost.decode_seq_s * seqs + cost.decode_context_s * context
                + cost.prefill_token_s * queued_tokens, cost.prefill_token_s, queued_tokens)

    @cached_property
    def counted_load(self) -> WorkerLoad:
        """Its load by the replicas' counts alone (its report is stale or missing)."""
        return WorkerLoad(self.all_queued_tokens, self.all_queued, self.all_inflight,
                          prompt_share=self.prompt_share)


@dataclass(frozen=True)
class ClusterState:
    workers: tuple[WorkerState, ...]
    now: float = 0.0  # the router's monotonic clock when the snapshot was taken
    config: RouterConfig = RouterConfig()  # staleness, queue bound, retry, mode, admission
    model: ModelInfo = ModelInfo("", 0, 0, 16)  # block size, KV bytes per block
    # (prefill worker, decode worker) -> its fitted transfer cost
    transfer: Mapping[tuple[str, str], TransferCost] = field(default_factory=dict)
    # Decode worker id -> this router's requests running there with a TPOT SLO. The
    # router's is a view computed for the workers a decision reads (of the same
    # moment: a decision is one synchronous call), not for every worker.
    budgets: Mapping[str, TpotBudgets] = field(default_factory=dict)
    # The router's last snapshot's workers as columns, which this one's start from
    # (worker_columns.py; None: built afresh).
    columns_memo: "ColumnsMemo | None" = field(default=None, compare=False)

    @property
    def stale_after_s(self) -> float:
        """A report older than this is unknown: never read as "full" or as "free"."""
        return self.config.telemetry_stale_s

    @property
    def max_queued_prefill_tokens(self) -> int:
        return self.config.max_queued_prefill_tokens

    @property
    def retry_after_s(self) -> float:
        return self.config.retry_after_s

    @property
    def adaptive(self) -> bool:
        """Workers in role both may also be paired (P on one, D on another)."""
        return self.config.adaptive

    @property
    def admission(self) -> str:
        return self.config.routing.admission

    @property
    def ttft_headroom(self) -> float:
        return self.config.routing.ttft_headroom

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block

    def report(self, worker: WorkerState) -> WorkerTelemetry | None:
        """The worker's telemetry if fresh, else None (unknown)."""
        if worker.telemetry is None or self.now - worker.heard_at > self.stale_after_s:
            return None
        return worker.telemetry

    def free_blocks(self, worker: WorkerState) -> int | None:
        report = self.report(worker)
        return None if report is None else report.free_blocks

    def step_cost(self, worker: WorkerState) -> StepCost:
        return worker.step_cost or DEFAULT_STEP_COST

    def transfer_cost(self, prefill: str, decode: str) -> TransferCost:
        return self.transfer.get((prefill, decode), DEFAULT_TRANSFER_COST)

    def load(self, worker: WorkerState) -> WorkerLoad:
        """Its load as a forecast reads it: the report's figures, or this router's own
        counts where they are higher (requests sent since the report) or the report
        is stale."""
        if self.report(worker) is None:
            return worker.counted_load
        return worker.reported_load


@dataclass(frozen=True)
class RequestView:
    """What placing a request needs to know of it."""
    num_prompt_tokens: int
    blocks_needed: int  # KV blocks its prompt and first token take on the decode side
    # Workers that refused this request already (no room when asked): not asked again.
    refused: frozenset[str] = frozenset()
    slo: Slo = Slo()
    priority: int = 0  # lower runs first (SamplingParams.priority)
    max_tokens: int = 16
    # Worker id -> leading prompt tokens found in its prefix cache, device or host
    # tier (others: none), and the seconds loading its host tier's part takes.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    host_load_s: Mapping[str, float] = field(default_factory=dict)
    sequence: int = 0  # the router's count of requests placed (round robin)
    # Seconds since it arrived (its TTFT counts them): a request that waited for
    # capacity has that much less of its TTFT SLO left.
    waited_s: float = 0.0
