"""The planner's view of the traffic, on hand-set arrivals (time is passed in)."""
from __future__ import annotations

import pytest

from pdserve.router.traffic import TrafficWindow


def test_a_steady_rate_is_read_with_no_trend_and_the_mean_lengths():
    window = TrafficWindow(window_s=60.0)
    for i in range(600):  # 10 req/s for 60 s
        window.arrived(i / 10, 100 + (i % 2) * 50)
        window.finished(i / 10, 40)
    traffic = window.traffic(60.0)
    assert traffic.rate == pytest.approx(10.0)
    assert abs(traffic.rate_slope) < 0.05
    assert traffic.isl == pytest.approx(125.0) and traffic.osl == pytest.approx(40.0)


def test_a_ramp_shows_its_slope_and_arrivals_age_out_of_the_window():
    window = TrafficWindow(window_s=60.0)
    t = 0.0
    while t < 60.0:  # the rate climbs 1 req/s each second: 1 at t=1 ... 60 at t=60
        rate = 1.0 + t
        window.arrived(t, 100)
        t += 1.0 / rate
    traffic = window.traffic(60.0)
    assert traffic.rate_slope == pytest.approx(1.0, rel=0.1)
    assert traffic.rate == pytest.approx(55.0, rel=0.1)  # the last 10 s: 50 -> 60
    assert window.traffic(71.0).rate == 0.0  # it stopped: none in the last 10 s
    assert window.traffic(121.0).rate_slope == 0.0  # nothing left in the window


def test_a_young_window_reads_its_rate_over_the_time_it_has_seen():
    window = TrafficWindow(window_s=60.0)
    for i in range(50):  # 5 req/s for the first 10 s
        window.arrived(i / 5, 10)
    assert window.traffic(10.0).rate == pytest.approx(5.0)
    assert TrafficWindow().traffic(5.0).rate == 0.0  # nothing yet
