"""What the planner reads of the traffic: requests arriving (refused ones included:
refused demand is demand) and the output of those finished, over a sliding window.
The rate is the last `recent_s` seconds' (a load that stopped reads as none within
them, where the window's mean would linger for its whole length); its trend is the
least-squares slope of the window's per-bucket arrival rates, so a rising load is
seen before the queue shows it. Pure: time is passed in."""
from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.router.planner import Traffic


class TrafficWindow:
    # 30 s: a trend fitted over a longer window lags a load that turns within minutes
    # (over 60 s, a 150 s sinusoid's slope read 30 s late, past its peak still rising).
    def __init__(self, window_s: float = 30.0, buckets: int = 12, recent_s: float = 10.0):
        if window_s <= 0 or buckets < 2 or not 0 < recent_s <= window_s:
            raise ValueError("window_s must be > 0, buckets >= 2, recent_s in (0, window_s]")
        self.window_s, self.buckets, self.recent_s = window_s, buckets, recent_s
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
        recent = min(self.recent_s, max(now - self._since, self.recent_s / self.buckets))
        rate = int(np.sum(times >= now - recent)) / recent
        width = span / self.buckets
        counts = np.histogram(times, bins=self.buckets, range=(now - span, now))[0] \
            if len(times) else np.zeros(self.buckets)
        mids = now - span + width * (np.arange(self.buckets) + 0.5)
        slope = float(np.polyfit(mids - now, counts / width, 1)[0])
        isl = float(np.mean([n for _, n in self._arrivals])) if self._arrivals else 0.0
        osl = float(np.mean([n for _, n in self._finished])) if self._finished else 0.0
        return Traffic(rate=rate, rate_slope=slope, isl=isl, osl=osl)
