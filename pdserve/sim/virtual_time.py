"""Virtual time for the simulator: an asyncio event loop whose clock jumps to the next
timer whenever nothing is ready to run, instead of sleeping. Sleeps, timeouts and
step durations cost no wall time, and the order of events is fixed by their virtual
times, so the same inputs give the same run. (The technique of aiotools'
VirtualClock and of looptime; neither is used because both poll the selector on
every advance, looptime for dozens of no-op cycles, and nothing here does I/O.)

The router reads time through its Clock: `LoopClock` is the loop's virtual time."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors

# The cyclic collector's thresholds while a simulation runs (Python's: 700, 10, 10). A
# simulation keeps millions of objects alive (each worker's KV blocks, requests and
# queues), and under the defaults the collector walked them all again and again: a
# third of the wall time of 1,000 workers (3,000 requests: 50 s, 33 s with these,
# 35 s with no collection at all, the same peak memory each; the run's 2,877 young
# collections freed 2,240 objects in all). Young collections still run, every 50,000
# allocations, so the rare cycle is still freed.
SIM_GC_THRESHOLDS = (50_000, 20, 100)


class SimulationStalled(RuntimeError):
    """Nothing was ready to run and no timer was set: every task waits on an event
    that nothing will ever set."""


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        self._now = start
        super().__init__(selector=_Skipping(self))

    def time(self) -> float:
        return self._now


class _Skipping(selectors.DefaultSelector):
    """Returns at once, moving the loop's clock by the time it was asked to wait."""

    def __init__(self, loop: VirtualTimeLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        if timeout is None:
            raise SimulationStalled("the simulation has nothing to run and no timer set")
        if timeout > 0:
            self._loop._now += timeout
        return []  # no I/O in a simulation


class LoopClock:
    """The router's Clock (router/clock.py) on a loop's virtual time: wall and
    monotonic time are the same virtual seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    def time(self) -> float:
        return self._loop.time()

    def monotonic(self) -> float:
        return self._loop.time()


def run(coro, start: float = 0.0):
    """Runs `coro` to its end on a fresh virtual-time loop and returns its result; as
    asyncio.run, the tasks it left are cancelled and awaited before the loop closes."""
    loop = VirtualTimeLoop(start)
    with sim_collector():
        try:
            return loop.run_until_complete(coro)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:  # gather() of nothing would make its future on another loop
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


@contextlib.contextmanager
def sim_collector():
    """The cyclic collector at SIM_GC_THRESHOLDS inside, as it was after (also around
    what reads a finished simulation's records while its objects are still alive: a
    full collection at the default thresholds walks them all)."""
    before = gc.get_threshold()
    gc.set_threshold(*SIM_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
