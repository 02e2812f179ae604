"""When each request is sent: Poisson at a rate, gamma with burstiness, or a trace's
timestamps. (Fixed concurrency has no schedule: the driver keeps N in flight.)"""
from __future__ import annotations

import random


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start. Gaps are gamma distributed with mean
    1/rate and shape `burstiness` (coefficient of variation 1/sqrt(burstiness));
    burstiness 1 is Poisson. rate = inf sends everything at once."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


def trace_times(timestamps: list[float]) -> list[float]:
    start = min(timestamps)
    return [t - start for t in timestamps]
