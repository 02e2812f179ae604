"""What the router learns of its workers for the latency model: a StepModel per
worker (fitted on the steps each telemetry report carries), a TransferModel per
(prefill, decode) pair (fitted on completed transfers), the prefix index (from the
reports' prefix-cache events), and a calibration from finished requests: what the
step model does not see (the router's own path, Ray calls, streaming) as an
average TTFT offset per placement kind and a TPOT ratio. A worker that leaves or
restarts is forgotten."""
from __future__ import annotations

from pdserve.engine.latency_model import StepCost, StepModel, TransferCost, TransferModel
from pdserve.engine.worker_messages import WorkerTelemetry
from pdserve.router.prefix_index import PrefixIndex

_WEIGHT = 0.02  # of each finished request in the calibration's average


class ClusterModels:
    def __init__(self) -> None:
        self.steps: dict[str, StepModel] = {}
        self.transfers: dict[tuple[str, str], TransferModel] = {}
        self.prefixes = PrefixIndex()
        self._transfer_costs: dict[tuple[str, str], TransferCost] = {}
        self.ttft_offset_s: dict[str, float] = {}  # placement kind -> measured - forecast
        self.tpot_ratio = 1.0  # measured / forecast
        self._calibrated: dict[str, int] = {}  # placement kind -> requests seen

    def calibrate(self, kind: str, forecast: tuple[float, float],
                  measured: tuple[float, float | None]) -> None:
        """A finished request's forecast (TTFT, TPOT) and what it measured: a plain
        mean over the first 50 requests, then an exponential average over about the
        last 50."""
        (ttft_f, tpot_f), (ttft, tpot) = forecast, measured
        seen = self._calibrated[kind] = self._calibrated.get(kind, 0) + 1
        weight = max(_WEIGHT, 1.0 / seen)
        raw_ttft = ttft_f - self.ttft_offset_s.get(kind, 0.0)
        offset = self.ttft_offset_s.get(kind, 0.0)
        self.ttft_offset_s = {**self.ttft_offset_s,
                              kind: offset + weight * (ttft - raw_ttft - offset)}
        if tpot is not None and tpot_f > 0:
            ratio = tpot / (tpot_f / self.tpot_ratio)
            self.tpot_ratio += weight * (min(max(ratio, 0.5), 2.0) - self.tpot_ratio)

    def reported(self, t: WorkerTelemetry) -> StepCost:
        """Takes in one report; returns the worker's step cost as now fitted."""
        model = self.steps.get(t.worker_id)
        if model is None:
            model = self.steps[t.worker_id] = StepModel()
        model.observe(t.steps)
        if t.prefix_stored or t.prefix_evicted:
            self.prefixes.update(t.worker_id, t.prefix_stored, t.prefix_evicted)
        return model.cost()

    def transferred(self, prefill: str, decode: str, nbytes: int, seconds: float) -> None:
        key = (prefill, decode)
        model = self.transfers.get(key)
        if model is None:
            model = self.transfers[key] = TransferModel()
        model.observe(nbytes, seconds)
        self._transfer_costs = {**self._transfer_costs, key: model.cost()}

    @property
    def transfer_costs(self) -> dict[tuple[str, str], TransferCost]:
        """Every pair's fitted cost (a new dict after each change: snapshots keep theirs)."""
        return self._transfer_costs

    def forget(self, worker_id: str) -> None:
        self.steps.pop(worker_id, None)
        self.prefixes.forget(worker_id)
        gone = [key for key in self.transfers if worker_id in key]
        for key in gone:
            del self.transfers[key]
        if gone:
            self._transfer_costs = {k: v for k, v in self._transfer_costs.items()
                                    if worker_id not in k}
