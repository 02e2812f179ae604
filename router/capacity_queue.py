"""The wait for capacity: requests the policy refused for want of it (KV, or headroom
under the running requests' TPOT SLOs) wait for some to free, served in order:
earliest deadline first (the last moment a placement can still meet the request's
TTFT SLO), then priority (lower first), then arrival.

When capacity may have freed, the waiters are asked in that order whether they fit
now (each decides again on a fresh snapshot). The first that fits is woken with its
decision and the others sleep on; once it has taken its place (its load counted),
the next are asked. At most `max_misses` waiters that still do not fit are asked per
freeing, so a long queue of requests that fit nowhere costs a bounded number of
decisions rather than one per waiter."""
from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, field
from typing import Callable

from pdserve.router.policy.decision import Decision, Reject

MAX_MISSES = 4


@dataclass(order=True)
class _Waiter:
    key: tuple[float, int, int]  # (deadline, priority, arrival sequence)
    fits: Callable[[], Decision] = field(compare=False)  # a decision on a fresh snapshot
    woken: asyncio.Future = field(compare=False)


class CapacityQueue:
    def __init__(self, max_misses: int = MAX_MISSES):
        self.max_misses = max_misses
        self._waiters: list[_Waiter] = []  # in order
        self._arrivals = itertools.count()
        self._asking = False  # a round of asking is scheduled

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float, priority: int, fits: Callable[[], Decision]
                   ) -> Decision:
        """Returns the decision that placed the request once it fits (its wait is
        bounded by the caller: cancel it to give up)."""
        waiter = _Waiter((deadline, priority, next(self._arrivals)), fits,
                         asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter)
        try:
            return await waiter.woken
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif not waiter.woken.cancelled():
                self.freed()  # woken as it gave up: the next in order is asked instead
            raise

    def freed(self) -> None:
        """Capacity may have freed (or the last woken request took its place): the
        waiters are asked, in order, once the running callbacks are done."""
        if self._waiters and not self._asking:
            self._asking = True
            asyncio.get_running_loop().call_soon(self._ask)

    def _ask(self) -> None:
        self._asking = False
        misses = 0
        for waiter in list(self._waiters):
            if waiter.woken.done():  # cancelled: its caller gave up; it leaves on its own
                continue
            decision = waiter.fits()
            if not isinstance(decision, Reject):
                self._waiters.remove(waiter)
                waiter.woken.set_result(decision)
                return
            misses += 1
            if misses >= self.max_misses:
                return
