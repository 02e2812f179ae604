"""The forecasts' calibration, pure (no torch, no Ray)."""
from __future__ import annotations

import math
import random

import pytest

from pdserve.engine.latency_calibration import Calibrator


def test_the_factor_learns_a_bias_that_noise_hides_in_single_requests():
    # The model forecasts 10 ms where requests measure 12 ms give or take 30%: after
    # a few hundred requests, forecasts as scaled are right in the (geometric) mean.
    rng, calibrator = random.Random(3), Calibrator(gain=0.05)
    for _ in range(400):
        forecast = calibrator.calibration.scale("tpot", "disaggregate", 0.010)
        calibrator.observe("tpot", "disaggregate", forecast,
                           0.012 * math.exp(rng.gauss(0, 0.3)))
    assert calibrator.calibration.factors[("tpot", "disaggregate")] == pytest.approx(1.2, rel=0.05)
    # each (metric, kind) learns apart: the others are untouched
    assert calibrator.calibration.scale("tpot", "colocate", 0.010) == 0.010
    assert calibrator.calibration.scale("ttft", "disaggregate", 0.010) == 0.010


def test_one_outlier_moves_the_factor_no_more_than_a_2x_miss_and_it_stays_bounded():
    calibrator = Calibrator(gain=0.05, low=0.5, high=2.0)
    calibrator.observe("ttft", "colocate", 0.1, 100.0)  # a request stuck for 100 s
    assert calibrator.calibration.factors[("ttft", "colocate")] == pytest.approx(2 ** 0.05)
    for _ in range(1000):
        calibrator.observe("ttft", "colocate", 0.1, 100.0)
    assert calibrator.calibration.factors[("ttft", "colocate")] == pytest.approx(2.0)
    calibrator.observe("ttft", "colocate", 0.1, float("nan"))  # lost: nothing learned
    calibrator.observe("ttft", "colocate", 0.0, 0.1)
    assert calibrator.calibration.factors[("ttft", "colocate")] == pytest.approx(2.0)


def test_bad_settings_and_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="gain"):
        Calibrator(gain=0.0)
    with pytest.raises(ValueError, match="low"):
        Calibrator(low=1.5)
    with pytest.raises(ValueError, match="kind"):
        Calibrator().observe("tpot", "split", 0.01, 0.01)
