"""The router's clocks, passed in rather than read from `time`: the system's in
production, the event loop's virtual time in the simulator (pdserve.sim), so the same
placement, admission and supervision code runs in both."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds: arrivals and token times (the workers' clock too)."""

    def monotonic(self) -> float:
        """Seconds that never step back: staleness, waits, the models' ages."""


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()
