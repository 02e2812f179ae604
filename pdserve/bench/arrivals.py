"""When each request is sent: Poisson at a rate, gamma with burstiness, or a trace's
timestamps. (Fixed concurrency has no schedule: the driver keeps N in flight.)"""
from __future__ import annotations

import itertools
import random
from typing import Iterator


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first `num` of `arrivals`."""
    return list(itertools.islice(arrivals(rate, burstiness, seed), num))


def arrivals(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Send times in seconds from the start, one after another, without end. Gaps are
    gamma distributed with mean 1/rate and shape `burstiness` (coefficient of
    variation 1/sqrt(burstiness)); burstiness 1 is Poisson. rate = inf sends
    everything at once."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if rate == float("inf"):
        return itertools.repeat(0.0)
    return _gamma_arrivals(random.Random(seed), 1.0 / (rate * burstiness), burstiness)


def _gamma_arrivals(rng: random.Random, scale: float, shape: float) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.gammavariate(shape, scale)


def trace_times(timestamps: list[float]) -> list[float]:
    start = min(timestamps)
    return [t - start for t in timestamps]
