"""A wait on state that offers no event (Ray's node list, the admin API, the planner's
decisions): read until the condition holds or the bound passes."""
from __future__ import annotations

import time
from typing import Callable


def until(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
