"""The forecasts' calibration, pure (no torch, no Ray)."""
from __future__ import annotations

import collections
import math
import random

import pytest

from pdserve.router.policy.latency_calibration import Calibrator


def test_the_factor_learns_a_bias_that_noise_hides_in_single_requests():
    # The model forecasts 10 ms where requests measure 12 ms give or take 30%: after
    # a few hundred requests, the factor is the bias (in the geometric mean).
    rng, calibrator = random.Random(3), Calibrator(gain=0.05)
    for i in range(400):
        calibrator.observe("tpot", "disaggregate", 0.010, 0.012 * math.exp(rng.gauss(0, 0.3)),
                           now=float(i))
    learned = calibrator.calibration(now=400.0)
    assert learned.factor("tpot", "disaggregate") == pytest.approx(1.2, rel=0.05)
    # each (metric, kind) learns apart: the others are untouched
    assert learned.factor("tpot", "colocate") == 1.0
    assert learned.factor("ttft", "disaggregate") == 1.0


@pytest.mark.parametrize("in_flight", [5, 40, 80])
def test_the_factor_holds_steady_however_many_requests_are_in_flight(in_flight):
    # Requests finish `in_flight` placements after they were placed, each placed
    # with the factor of its time. Learned from forecasts as scaled, the correction
    # would be applied about in_flight times before its effect showed, and the
    # factor swung between its bounds (0.5-2.0 at 40); learned from the model's own
    # forecast, it stays at the bias whatever the delay.
    rng, calibrator = random.Random(1), Calibrator()
    flight: collections.deque = collections.deque()
    seen = []
    for i in range(2000):
        factor = calibrator.calibration(now=float(i)).factor("tpot", "colocate")
        flight.append(0.010)  # the model's own forecast (placed as 0.010 * factor)
        if len(flight) > in_flight:
            calibrator.observe("tpot", "colocate", flight.popleft(),
                               0.012 * math.exp(rng.gauss(0, 0.1)), now=float(i))
        seen.append(factor)
    assert 1.12 < min(seen[1000:]) and max(seen[1000:]) < 1.28


def test_one_outlier_moves_the_factor_no_more_than_a_2x_miss_and_it_stays_bounded():
    calibrator = Calibrator(gain=0.05, low=0.5, high=2.0)
    calibrator.observe("ttft", "colocate", 0.1, 100.0, now=0.0)  # a request stuck for 100 s
    assert calibrator.calibration(0.0).factor("ttft", "colocate") == pytest.approx(2 ** 0.05)
    for _ in range(1000):
        calibrator.observe("ttft", "colocate", 0.1, 100.0, now=0.0)
    assert calibrator.calibration(0.0).factor("ttft", "colocate") == pytest.approx(2.0)
    calibrator.observe("ttft", "colocate", 0.1, float("nan"), now=0.0)  # lost: nothing learned
    calibrator.observe("ttft", "colocate", 0.0, 0.1, now=0.0)
    assert calibrator.calibration(0.0).factor("ttft", "colocate") == pytest.approx(2.0)


def test_a_factor_nothing_measured_for_the_max_age_is_dropped():
    # A worker whose factor grew under contention is forecast slow and gets no
    # requests: nothing would ever correct it. Past max_age_s it forecasts as its
    # model does, and the next measurement starts afresh.
    calibrator = Calibrator(gain=0.5, max_age_s=120.0)
    calibrator.observe("ttft", "colocate", 0.1, 0.2, now=10.0)
    calibrator.observe("tpot", "colocate", 0.01, 0.02, now=100.0)
    assert calibrator.calibration(130.0).factor("ttft", "colocate") == pytest.approx(2 ** 0.5)
    aged = calibrator.calibration(131.0)
    assert aged.factor("ttft", "colocate") == 1.0
    assert aged.factor("tpot", "colocate") == pytest.approx(2 ** 0.5)  # measured later
    calibrator.observe("ttft", "colocate", 0.1, 0.2, now=140.0)
    assert calibrator.calibration(140.0).factor("ttft", "colocate") == pytest.approx(2 ** 0.5)
    assert Calibrator(max_age_s=None).calibration(1e9).factors == {}


def test_bad_settings_and_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="gain"):
        Calibrator(gain=0.0)
    with pytest.raises(ValueError, match="low"):
        Calibrator(low=1.5)
    with pytest.raises(ValueError, match="max_age_s"):
        Calibrator(max_age_s=0.0)
    with pytest.raises(ValueError, match="kind"):
        Calibrator().observe("tpot", "split", 0.01, 0.01, now=0.0)
