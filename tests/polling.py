"""A wait on state that offers no event (Ray's node list, the admin API, the planner's
decisions): read until the condition holds or the bound passes."""
from __future__ import annotations

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
