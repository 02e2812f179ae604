"""How far a worker's forecasts run from what its requests then measure, so later
forecasts can be scaled by it. The step and transfer models forecast the mechanics
of a request's steps; what they leave out (prompts that arrive while it decodes, CPU
or link contention between workers, the time tokens take to reach the router) shows
up as a bias of measured / forecast, which this learns per worker, per metric (ttft
on the worker that computes the prompt, tpot on the one decoding) and per kind of
placement (colocate | disaggregate), whose biases differ.

The factor is a moving geometric mean of measured / forecast, the forecast taken
before any calibration: each finished request moves log(factor) by `gain` of the way
to log(measured / forecast). It learns from the model's own forecast, not from the
forecast as scaled, because a request finishes long after it was placed: with N
requests in flight, a correction learned from scaled forecasts is applied about N
times before its effect is seen, and the factor swings between its bounds once gain
* N passes about 1.5 (a decode batch of 40 does). One request counts as off by the
bounds at most, so an outlier (a request stuck behind a restart) moves the factor no
more than a bad forecast does. A factor nothing measured for `max_age_s` is dropped:
a worker whose factor grew under contention gets no requests, and nothing else would
ever correct it (the step models age out for the same reason).
Pure: the router and a capacity simulator share it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

METRICS = ("ttft", "tpot")
KINDS = ("colocate", "disaggregate")


@dataclass(frozen=True)
class Calibration:
    """Factors to scale a worker's forecasts by: (metric, kind) -> factor (1 where
    nothing was learned)."""
    factors: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def factor(self, metric: str, kind: str) -> float:
        return self.factors.get((metric, kind), 1.0)


NONE = Calibration()


class Calibrator:
    """One worker's Calibration, learned from its finished requests."""

    def __init__(self, gain: float = 0.05, low: float = 0.5, high: float = 2.0,
                 max_age_s: float | None = 120.0):
        """gain: how far one request moves the factor (about 1/gain requests make
        its memory); low, high: the factor's bounds (a forecast off by more than that
        is a broken model, not a bias); max_age_s: a factor with no measurement for
        that long is dropped (None: never)."""
        if not 0 < gain <= 1 or not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < gain <= 1 and 0 < low <= 1 <= high, got "
                             f"gain={gain} low={low} high={high}")
        if max_age_s is not None and not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 or None, got {max_age_s}")
        self.gain, self.max_age_s = gain, max_age_s
        self._low, self._high = math.log(low), math.log(high)
        self._log: dict[tuple[str, str], float] = {}
        self._at: dict[tuple[str, str], float] = {}  # when each was last measured
        self._made: Calibration | None = None  # as last built (None: build anew)

    def observe(self, metric: str, kind: str, forecast_s: float, measured_s: float,
                now: float) -> None:
        """One finished request: the model's forecast for it before any calibration,
        and what it measured; `now` on the clock `calibration` is read with."""
        if metric not in METRICS or kind not in KINDS:
            raise ValueError(f"unknown metric {metric!r} or kind {kind!r}")
        if not (forecast_s > 0 and measured_s > 0 and math.isfinite(forecast_s)
                and math.isfinite(measured_s)):
            return  # nothing to learn from a lost measurement
        key = (metric, kind)
        self._age(now)
        off = min(max(math.log(measured_s / forecast_s), self._low), self._high)
        was = self._log.get(key, 0.0)
        self._log[key] = was + self.gain * (off - was)
        self._at[key] = now
        self._made = None

    def calibration(self, now: float) -> Calibration:
        """The factors measured within max_age_s of `now`."""
        self._age(now)
        if self._made is None:
            self._made = Calibration({k: math.exp(v) for k, v in self._log.items()})
        return self._made

    def _age(self, now: float) -> None:
        if self.max_age_s is None:
            return
        old = [k for k, at in self._at.items() if now - at > self.max_age_s]
        for key in old:
            del self._log[key], self._at[key]
        if old:
            self._made = None
