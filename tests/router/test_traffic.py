"""The planner's view of the traffic, on hand-set arrivals (time is passed in)."""
from __future__ import annotations

import math
import random

import pytest

from pdserve.router.planner.traffic import TrafficWindow, outcomes, refused
from pdserve.router.slo import Slo


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


def sinusoid(t: float, lo: float = 22.0, hi: float = 88.0, period_s: float = 150.0) -> float:
    """Dynamo's planner trace: lo at t = 0, hi half a period later."""
    return (lo + hi) / 2 + (hi - lo) / 2 * math.sin(2 * math.pi * t / period_s - math.pi / 2)


def arrivals(rate, until_s: float, window: TrafficWindow, seed=None) -> None:
    """At rate(t): Poisson with a seed (thinned from the rate's ceiling), else evenly
    spaced (the integral of the rate crossing each whole number)."""
    if seed is not None:
        rng, t = random.Random(seed), 0.0
        while (t := t + rng.expovariate(100.0)) < until_s:
            if rng.random() < rate(t) / 100.0:
                window.arrived(t, 100)
        return
    t, owed = 0.0, 0.0
    while t < until_s:
        owed += rate(t) * 0.01
        while owed >= 1.0:
            window.arrived(t, 100)
            owed -= 1.0
        t += 0.01


def test_a_repeating_load_is_read_ahead_on_its_last_period_s_course():
    """At the trough of the third period the trend reads flat (the load has only just
    turned), while a worker asked for now serves 28 s later, into the rise: the
    course one period ago says how far it rises."""
    window = TrafficWindow()
    arrivals(sinusoid, 450.0, window, seed=3)
    traffic = window.traffic(450.0)
    assert len(traffic.echo) - traffic.echo_lead == pytest.approx(30, abs=2)  # 150 s
    assert traffic.ahead(28.0) == pytest.approx(sinusoid(478.0), rel=0.15)  # 42 req/s
    # the trend alone: the rate now, give or take, 2x short of it
    assert traffic.rate + traffic.rate_slope * 28.0 < 0.7 * sinusoid(478.0)


def test_a_load_that_does_not_repeat_is_read_on_its_trend():
    steady = TrafficWindow()
    arrivals(lambda t: 40.0, 450.0, steady, seed=5)  # Poisson: bins match by chance only
    traffic = steady.traffic(450.0)
    assert traffic.echo == () and traffic.ahead(28.0) == pytest.approx(
        traffic.rate + traffic.rate_slope * 28.0)
    # a ramp matches itself at every lag: its course, shifted to now, goes on rising
    ramp = TrafficWindow()
    arrivals(lambda t: 10.0 + 0.2 * t, 300.0, ramp)
    rising = ramp.traffic(300.0)
    assert rising.echo and rising.ahead(28.0) == pytest.approx(10.0 + 0.2 * 328.0, rel=0.1)


def test_an_idle_history_longer_than_the_bins_starts_afresh():
    window = TrafficWindow(history_s=300.0)
    arrivals(sinusoid, 450.0, window)
    assert window.traffic(450.0).echo
    window.arrived(5000.0, 100)  # after an hour and more without a request
    assert list(window._bins) == [1]
    assert window.traffic(5001.0).echo == () and sum(window._bins) == 1


@pytest.mark.parametrize("bad", [dict(bin_s=0.0), dict(bin_s=20.0),
                                 dict(min_period_s=600.0), dict(min_correlation=0.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        TrafficWindow(**bad)


def test_each_pool_answers_for_the_slo_term_it_served():
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    # Disaggregated: the prefill pool on the TTFT, the decode pool on the TPOT.
    assert outcomes("prefill", "decode", slo, 0.6, 0.04) == (("prefill", False),
                                                              ("decode", True))
    # One pool did both: met only if both are.
    assert outcomes("both", "both", slo, 0.4, 0.06) == (("both", False),)
    assert outcomes("both", "both", slo, 0.4, 0.04) == (("both", True),)
    # One token: no TPOT to judge; no targets: nothing to judge.
    assert outcomes("both", "both", slo, 0.4, None) == (("both", True),)
    assert outcomes("prefill", "decode", Slo(ttft_s=0.5), 0.6, 0.5) == (("prefill", False),)
    assert outcomes("both", "both", Slo(), 9.0, 9.0) == ()
    # Refused for want of capacity: a miss of the pools present that lacked it.
    assert refused("ttft", {"prefill", "decode"}) == (("prefill", False),)
    assert refused("kv", {"prefill", "decode"}) == (("decode", False),)
    assert refused("harm", {"both"}) == (("both", False),)
    assert refused("overloaded", {"prefill", "decode"}) == (("decode", False),
                                                            ("prefill", False))


def test_attainment_is_read_per_pool_over_the_last_seconds():
    window = TrafficWindow(recent_s=10.0)
    window.arrived(0.0, 100)
    for i in range(40):  # every 0.5 s for 20 s, the decode pool missing every other one
        window.judged(i * 0.5, (("prefill", True), ("decode", i % 2 == 0)))
    traffic = window.traffic(20.0)
    assert traffic.attainment("prefill") == (20, 20)  # 10 s back: from t = 10 on
    assert traffic.attainment("decode") == (10, 20)
    assert traffic.attainment("both") == (0, 0)
    assert window.traffic(40.0).attainment("decode") == (0, 0)  # aged out


def test_a_window_no_planner_reads_holds_only_its_window():
    """The router counts every request whether or not a planner reads the window
    (without --autoscale none does): what it keeps must age out as it records."""
    window = TrafficWindow(window_s=30.0, recent_s=10.0)
    for i in range(100_000):  # 10 req/s for 10,000 s
        window.arrived(i / 10, 100)
        window.finished(i / 10, 40)
        window.judged(i / 10, (("both", True),))
    kept = [len(window._arrivals), len(window._finished), len(window._judged)]
    assert kept[0] <= 301 and kept[1] <= 301 and kept[2] <= 101, kept
