"""A worker's lane to one peer: its calls run in order on one thread, except that an
urgent call (a paused request's last copy, in a live migration) runs before the
calls queued ahead of it; closing lets the calls queued before it run first."""
from __future__ import annotations

import threading

from pdserve.prefill_worker.role import _Lane


def test_an_urgent_call_runs_before_those_queued_and_close_after_them():
    lane, ran, held = _Lane("test-lane"), [], threading.Event()
    first = lane.submit(held.wait, 30)  # the lane is busy with it while the rest queue
    calls = [lane.submit(ran.append, name) for name in ("precopy-1", "precopy-2")]
    urgent = lane.submit(ran.append, "last copy", urgent=True)
    lane.close(join=False)
    after_close = lane.submit(ran.append, "never")
    held.set()
    for future in (first, *calls, urgent):
        future.result(30)
    lane._thread.join(30)
    assert ran == ["last copy", "precopy-1", "precopy-2"]
    assert not after_close.done()
