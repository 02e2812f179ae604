"""What the planner reads of the traffic: requests arriving (refused ones included:
refused demand is demand) and the output of those finished, over a sliding window.
The rate's trend is the least-squares slope of the per-bucket arrival rates, so a
rising load is seen before the queue shows it. Pure: time is passed in."""
from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.router.planner import Traffic


class TrafficWindow:
    def __init__(self, window_s: float = 60.0, buckets: int = 12):
        if window_s <= 0 or buckets < 2:
            raise ValueError("window_s must be > 0 and buckets >= 2")
        self.window_s, self.buckets = window_s, buckets
        self._arrivals: deque = deque()  # (time, prompt tokens)
        self._finished: deque = deque()  # (time, output tokens)
        self._since: float | None = None  # the first arrival: a young window is shorter

    def arrived(self, now: float, prompt_tokens: int) -> None:
        if self._since is None:
            self._since = now
        self._arrivals.append((now, prompt_tokens))

    def finished(self, now: float, output_tokens: int) -> None:
        self._finished.append((now, output_tokens))

    def traffic(self, now: float) -> Traffic:
        start = now - self.window_s
        for items in (self._arrivals, self._finished):
            while items and items[0][0] < start:
                items.popleft()
        if self._since is None:
            return Traffic()
        span = min(self.window_s, max(now - self._since, self.window_s / self.buckets))
        times = np.array([t for t, _ in self._arrivals])
        rate = len(times) / span
        width = span / self.buckets
        counts = np.histogram(times, bins=self.buckets, range=(now - span, now))[0] \
            if len(times) else np.zeros(self.buckets)
        mids = now - span + width * (np.arange(self.buckets) + 0.5)
        slope = float(np.polyfit(mids - now, counts / width, 1)[0])
        isl = float(np.mean([n for _, n in self._arrivals])) if self._arrivals else 0.0
        osl = float(np.mean([n for _, n in self._finished])) if self._finished else 0.0
        return Traffic(rate=rate, rate_slope=slope, isl=isl, osl=osl)
