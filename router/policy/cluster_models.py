"""What the router learns of its workers for the latency model: a StepModel and a
PromptShare per worker (fitted on, and measured from, the steps each telemetry
report carries), a Calibrator per worker (learned from its finished requests), a
TransferModel per (prefill, decode) pair (fitted on completed transfers), the
prefix indexes of the device caches and of the host tiers (from the reports'
prefix-cache events) and what loading a block from each worker's host tier takes. A worker that leaves or restarts is forgotten.

A worker's step model is seeded by the first steps seen of it (its start-up profile,
when this router was there to see it) and forgets steps older than STEP_MAX_AGE_S:
refused requests make no steps, so a model inflated by steps measured under
contention would otherwise refuse an idle worker its work for ever. A pair's
transfer model forgets its transfers as old, for the same reason."""
from __future__ import annotations

from collections.abc import Container

from pdserve.engine.latency_model import (
    PromptShare,
    StepCost,
    StepModel,
    TransferCost,
    TransferModel,
)
from pdserve.router.policy.decision import Colocate, Disaggregate, placement_kind
from pdserve.router.policy.latency_calibration import NONE, Calibration, Calibrator
from pdserve.router.policy.prefix_index import PrefixIndex
from pdserve.worker.messages import WorkerTelemetry

STEP_MAX_AGE_S = 120.0
# A worker's step model is refitted at most this often (on the worker's clock): it
# reports every step, and a fit is a least-squares solve over its window.
REFIT_INTERVAL_S = 1.0


class ClusterModels:
    def __init__(self, step_max_age_s: float = STEP_MAX_AGE_S) -> None:
        self.step_max_age_s = step_max_age_s
        self.steps: dict[str, StepModel] = {}
        self.prompt_shares: dict[str, PromptShare] = {}
        self.calibrators: dict[str, Calibrator] = {}
        self.transfers: dict[tuple[str, str], TransferModel] = {}
        self.prefixes = PrefixIndex()
        self.host_prefixes = PrefixIndex()
        self.host_load_s: dict[str, float] = {}  # worker -> seconds a block, from its host tier
        self._transfer_costs: dict[tuple[str, str], TransferCost] = {}
        self._aged_at = float("-inf")

    def reported(self, t: WorkerTelemetry) -> tuple[StepCost, float]:
        """Takes in one report; returns the worker's step cost as now fitted, and its
        prompt share as now measured."""
        model = self.steps.get(t.worker_id)
        if model is None:  # seeded by the first steps seen (the default prior if none)
            model = self.steps[t.worker_id] = StepModel.seeded(
                t.steps, max_age_s=self.step_max_age_s,
                min_refit_interval_s=REFIT_INTERVAL_S)
        else:
            model.observe(t.steps)
        if t.prefix_stored or t.prefix_evicted:
            self.prefixes.update(t.worker_id, t.prefix_stored, t.prefix_evicted)
        if t.host_prefix_stored or t.host_prefix_evicted:
            self.host_prefixes.update(t.worker_id, t.host_prefix_stored, t.host_prefix_evicted)
        if t.host_load_s_per_block:
            self.host_load_s[t.worker_id] = t.host_load_s_per_block
        cost = model.cost(now=t.time)
        share = self.prompt_shares.get(t.worker_id)
        if share is None:
            share = self.prompt_shares[t.worker_id] = PromptShare()
        share.observe(t.steps, cost)
        return cost, share.share(t.time)

    def measured(self, worker_id: str, metric: str, kind: str, forecast_s: float,
                 measured_s: float, now: float) -> Calibration:
        """One finished request's forecast (before calibration) and measurement, at
        `now` on the router's clock; returns the worker's calibration as now learned."""
        calibrator = self.calibrators.get(worker_id)
        if calibrator is None:
            calibrator = self.calibrators[worker_id] = Calibrator(max_age_s=self.step_max_age_s)
        calibrator.observe(metric, kind, forecast_s, measured_s, now)
        return calibrator.calibration(now)

    def request_finished(self, decision: Colocate | Disaggregate, waited_s: float,
                         ttft_s: float, tpot_s: float | None, now: float,
                         members: Container[str]) -> dict[str, Calibration]:
        """A finished request's latencies: the calibration of the workers whose
        forecasts it was placed by learns how far they were off (the TTFT from its
        placement, after waiting `waited_s`, as forecast then; the TPOT of its decode
        worker). Returns each such worker's calibration as now learned; a worker no
        longer among `members` took its calibration with it."""
        if decision.ttft_s is None:
            return {}  # a policy without a model forecast nothing
        kind = placement_kind(decision)
        computes, decodes = ((decision.worker, decision.worker) if kind == "colocate"
                             else (decision.prefill, decision.decode))
        # What the model forecast itself: the factors it was scaled by divided out.
        learned = [(computes, "ttft", (decision.ttft_s - waited_s) / decision.ttft_scale,
                    ttft_s - waited_s)]
        if tpot_s is not None and decision.tpot_s:
            learned.append((decodes, "tpot", decision.tpot_s / decision.tpot_scale, tpot_s))
        return {worker: self.measured(worker, metric, kind, forecast, measured, now)
                for worker, metric, forecast, measured in learned if worker in members}

    def calibration(self, worker_id: str, now: float) -> Calibration:
        """The worker's calibration at `now` (the router's clock): factors measured
        within the max age."""
        calibrator = self.calibrators.get(worker_id)
        return NONE if calibrator is None else calibrator.calibration(now)

    def transferred(self, prefill: str, decode: str, nbytes: int, seconds: float,
                    now: float) -> None:
        """One completed transfer, at `now` on the router's clock."""
        key = (prefill, decode)
        model = self.transfers.get(key)
        if model is None:
            model = self.transfers[key] = TransferModel(max_age_s=self.step_max_age_s)
        model.observe(nbytes, seconds, now)
        self._transfer_costs = {**self._transfer_costs, key: model.cost(now)}

    def age_transfers(self, now: float) -> None:
        """Re-costs the pairs whose transfers aged out by `now` (the router's clock):
        a pair whose fit was inflated gets no transfers to correct it, as no request
        is placed on it, so it forecasts its prior again once they are old. At most
        once a second: it is called on every report."""
        if now - self._aged_at < 1.0:
            return
        self._aged_at = now
        aged = {key: model.cost(now) for key, model in self.transfers.items()}
        if aged != self._transfer_costs:
            self._transfer_costs = aged

    @property
    def transfer_costs(self) -> dict[tuple[str, str], TransferCost]:
        """Every pair's fitted cost (a new dict after each change: snapshots keep theirs)."""
        return self._transfer_costs

    def forget(self, worker_id: str) -> None:
        self.steps.pop(worker_id, None)
        self.prompt_shares.pop(worker_id, None)
        self.calibrators.pop(worker_id, None)
        self.prefixes.forget(worker_id)
        self.host_prefixes.forget(worker_id)
        self.host_load_s.pop(worker_id, None)
        gone = [key for key in self.transfers if worker_id in key]
        for key in gone:
            del self.transfers[key]
        if gone:
            self._transfer_costs = {k: v for k, v in self._transfer_costs.items()
                                    if worker_id not in k}
