"""Inter-token latencies of a simulated run, counted where the tokens are made: a
simulated worker steps a steady batch many steps at a time, and a run may make
hundreds of millions of tokens, so gaps go into a histogram rather than a list per
request. Bins are 0.1% wide on a log scale from 1 us to 1,000 s: a percentile is
exact to 0.1%, the mean exact."""
from __future__ import annotations

import math

import numpy as np

_LOW_S, _HIGH_S = 1e-6, 1e3
_RATIO = 1.001


class ItlHistogram:
    def __init__(self) -> None:
        self._log_ratio = math.log(_RATIO)
        size = int(math.log(_HIGH_S / _LOW_S) / self._log_ratio) + 2
        self._counts = np.zeros(size, dtype=np.int64)
        self._total_s = 0.0
        self._n = 0

    def add(self, gaps_s, weight: int = 1) -> None:
        """Gaps (seconds), each counted `weight` times."""
        gaps = np.asarray(gaps_s, dtype=np.float64)
        if not gaps.size or weight <= 0:
            return
        index = np.clip(np.log(np.maximum(gaps, _LOW_S) / _LOW_S) / self._log_ratio, 0,
                        self._counts.size - 1).astype(np.int64)
        np.add.at(self._counts, index, weight)
        self._total_s += float(gaps.sum()) * weight
        self._n += gaps.size * weight

    def add_one(self, gap_s: float) -> None:
        """One gap: add()'s bin without arrays (a token reaching the router alone
        comes here, a million times in a run of minutes)."""
        i = int(math.log(max(gap_s, _LOW_S) / _LOW_S) / self._log_ratio)
        self._counts[min(max(i, 0), self._counts.size - 1)] += 1
        self._total_s += gap_s
        self._n += 1

    def stats_ms(self, percentiles=(50, 90, 99)) -> dict:
        """The bench's ITL statistics: mean and percentiles, in milliseconds."""
        if not self._n:
            return {"mean": None, **{f"p{p}": None for p in percentiles}}
        cumulative = np.cumsum(self._counts)
        out = {"mean": self._total_s / self._n * 1e3}
        for p in percentiles:
            i = int(np.searchsorted(cumulative, p / 100 * self._n))
            out[f"p{p}"] = _LOW_S * _RATIO ** (i + 0.5) * 1e3  # the bin's middle
        return out
