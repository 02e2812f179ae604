"""The receiver's side of one pair's data stream: every slot the STEP messages
announced, in stream order, with receives posted ahead of the payloads.

A gloo send moves no byte until its receive is posted, and an NCCL send waits on the
GPU for its peer's: a receive posted only when its payload is due costs a round trip
per payload. Here a step's receives are posted as soon as its STEP arrives, up to
`window_bytes` of posted buffers (always at least one receive), and each landing
posts the next. The window bounds the staging memory a step of long prompts can
hold; below it, the whole step is posted before its first layer is gathered.

Posting order is stream order: `plan` (the control thread) and `landed` (the
collector) post under one lock, from one queue.
"""
from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass

from pdserve.kv_transfer.buffer_pool import BufferPool


@dataclass(frozen=True)
class Slot:
    """One announced payload: layer `layer` of a transfer, exactly `nbytes`. `owner`
    is the receiver's record of the transfer, or None for a payload to drop."""
    owner: object
    layer: int
    nbytes: int


class ReceiveWindow:
    def __init__(self, data, pool: BufferPool, window_bytes: int):
        """`data`: the pair's data stream (data_plane.py)."""
        self._data = data
        self._pool = pool
        self._window_bytes = window_bytes
        self._lock = threading.Lock()
        self._planned: collections.deque[Slot] = collections.deque()
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._posted_bytes = 0
        self._posted_count = 0
        self._closed = False

    def plan(self, slots: list[Slot]) -> None:
        """Append a step's slots to the stream, posting what the window allows."""
        with self._lock:
            self._planned.extend(slots)
            self._fill()

    def next(self):
        """The next posted receive in stream order, as (slot, work, buffer); blocks
        until one is posted; None once the window is closed and drained."""
        return self._posted.get()

    def landed(self, slot: Slot) -> None:
        """`slot`'s receive completed and its buffer is handed on: post more."""
        with self._lock:
            self._posted_bytes -= slot.nbytes
            self._posted_count -= 1
            self._fill()

    def close(self) -> None:
        """Post nothing more; `next` returns what is posted, then None."""
        with self._lock:
            self._closed = True
            self._posted.put(None)

    def _fill(self) -> None:
        while self._planned and not self._closed and (
                self._posted_count == 0
                or self._posted_bytes + self._planned[0].nbytes <= self._window_bytes):
            slot = self._planned.popleft()
            buffer = self._pool.get(slot.nbytes, self._data.device)
            work = self._data.post_recv(buffer[:slot.nbytes])
            self._posted_bytes += slot.nbytes
            self._posted_count += 1
            self._posted.put((slot, work, buffer))

