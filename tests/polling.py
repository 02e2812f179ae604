"""A wait on state that offers no event (Ray's node list, the admin API, the planner's
decisions, what a Redis holds): read until the condition holds or the bound passes.
`until` from a thread, `eventually` on an event loop (its reads may be coroutines)."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def until(condition: Callable[[], T], timeout_s: float, every_s: float = 0.1) -> T | bool:
    """The condition's first truthy value, or False once `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return value


async def eventually(condition: Callable, timeout_s: float = 10.0,
                     every_s: float = 0.05) -> bool:
    """`until` on the running loop: `condition()` may return a coroutine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value or loop.time() > deadline:
            return bool(value)
        await asyncio.sleep(every_s)
