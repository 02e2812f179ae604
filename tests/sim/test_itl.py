"""The simulator's inter-token latency histogram, pure: its statistics against the
gaps computed exactly, and a gap added alone binned as among many."""
from __future__ import annotations

import numpy as np

from pdserve.sim.itl import ItlHistogram


def test_percentiles_are_within_a_bin_and_the_mean_is_exact():
    gaps = np.random.default_rng(0).lognormal(-4.0, 1.0, 50_000)
    h = ItlHistogram()
    h.add(gaps[:20_000])
    h.add(gaps[20_000:30_000], weight=2)  # a steady stretch: each gap for 2 requests
    for g in gaps[30_000:]:
        h.add_one(float(g))
    every = np.concatenate([gaps[:20_000], np.repeat(gaps[20_000:30_000], 2), gaps[30_000:]])
    stats = h.stats_ms()
    assert abs(stats["mean"] - every.mean() * 1e3) < 1e-9 * stats["mean"]
    for p in (50, 90, 99):
        exact = np.percentile(every, p) * 1e3
        assert abs(stats[f"p{p}"] / exact - 1) < 2e-3, (p, stats[f"p{p}"], exact)


def test_a_gap_added_alone_lands_in_the_bin_it_lands_in_among_many():
    rng = np.random.default_rng(1)
    # across the range, past both ends (clipped into the first and last bins), and on
    # bin edges
    gaps = np.concatenate([rng.lognormal(-5.0, 3.0, 20_000), [0.0, 1e-9, 1e-6, 1e3, 5e3],
                           1e-6 * 1.001 ** np.arange(0, 2000, 97)])
    many, alone = ItlHistogram(), ItlHistogram()
    many.add(gaps)
    for g in gaps:
        alone.add_one(float(g))
    assert np.array_equal(many._counts, alone._counts)
    a, b = many.stats_ms(), alone.stats_ms()
    assert abs(a.pop("mean") / b.pop("mean") - 1) < 1e-12  # summed in another order
    assert a == b
