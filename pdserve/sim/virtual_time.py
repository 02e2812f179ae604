"""Virtual time for the simulator: an asyncio event loop whose clock jumps to the next
timer whenever nothing is ready to run, instead of sleeping. Sleeps, timeouts and
step durations cost no wall time, and the order of events is fixed by their virtual
times, so the same inputs give the same run. (The technique of aiotools'
VirtualClock and of looptime; neither is used because both poll the selector on
every advance, looptime for dozens of no-op cycles, and nothing here does I/O.)

The router reads time through its Clock: `LoopClock` is the loop's virtual time."""
from __future__ import annotations

import asyncio
import selectors


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
    try:
        return loop.run_until_complete(coro)
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
