"""How far a worker's forecasts have run from what its requests then measured, so
later forecasts can be scaled by it. The step and transfer models forecast the
mechanics of a request's steps; what they leave out (prompts that arrive while it
decodes, CPU or link contention between workers, the time tokens take to reach the
router) shows up as a bias of measured / predicted, which this learns per worker,
per metric (ttft on the worker that computes the prompt, tpot on the one decoding)
and per kind of placement (colocate | disaggregate), whose biases differ.

The factor is the running geometric mean of measured / forecast, as the forecast
was scaled when made: each finished request moves log(factor) by `gain` times
log(measured / forecast), so a factor that already removes the bias stays put. One
request counts as off by 2x at most: an outlier (a request stuck behind a restart)
moves the factor no more than a bad forecast does.
Pure: the router and a capacity simulator share it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

METRICS = ("ttft", "tpot")
KINDS = ("colocate", "disaggregate")
_MAX_OFF = math.log(2.0)  # the most one request counts as off by (log)


@dataclass(frozen=True)
class Calibration:
    """Factors to scale a worker's forecasts by: (metric, kind) -> factor (1 where
    nothing was learned)."""
    factors: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def scale(self, metric: str, kind: str, seconds: float) -> float:
        return seconds * self.factors.get((metric, kind), 1.0)


NONE = Calibration()


class Calibrator:
    """One worker's Calibration, learned from its finished requests."""

    def __init__(self, gain: float = 0.05, low: float = 0.5, high: float = 2.0):
        """gain: how far one request moves the factor (about 1/gain requests make
        its memory); low, high: the factor's bounds (a forecast off by more than that
        is a broken model, not a bias)."""
        if not 0 < gain <= 1 or not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < gain <= 1 and 0 < low <= 1 <= high, got "
                             f"gain={gain} low={low} high={high}")
        self.gain, self._low, self._high = gain, math.log(low), math.log(high)
        self._log: dict[tuple[str, str], float] = {}
        self.calibration = NONE

    def observe(self, metric: str, kind: str, forecast_s: float, measured_s: float) -> None:
        """One finished request: its forecast (as scaled when made) and measurement."""
        if metric not in METRICS or kind not in KINDS:
            raise ValueError(f"unknown metric {metric!r} or kind {kind!r}")
        if not (forecast_s > 0 and measured_s > 0 and math.isfinite(forecast_s)
                and math.isfinite(measured_s)):
            return  # nothing to learn from a lost measurement
        key = (metric, kind)
        off = min(max(math.log(measured_s / forecast_s), -_MAX_OFF), _MAX_OFF)
        step = self.gain * off
        self._log[key] = min(max(self._log.get(key, 0.0) + step, self._low), self._high)
        self.calibration = Calibration({k: math.exp(v) for k, v in self._log.items()})
