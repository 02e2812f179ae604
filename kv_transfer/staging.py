"""Sends that must wait for a device-to-host copy, issued in order off the engine thread.

A CUDA cache sent over gloo is gathered and copied to pinned host memory on a side
stream; the copy completes by a CUDA event. The engine thread records the event and
moves on; this thread waits for each event in submission order and then issues the
send, so a pair's announcements and payloads keep the order they were staged in.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class HostStager:
    def __init__(self, name: str = "kv-stager"):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, ready, send: Callable[[], object]) -> Future:
        """`ready.synchronize()` returns once the bytes are in host memory (a CUDA
        event); the Future resolves to what `send()` returned, or its exception."""
        future: Future = Future()
        self._queue.put((ready, send, future))
        return future

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ready, send, future = item
            try:
                ready.synchronize()
                future.set_result(send())
            except BaseException as exc:
                future.set_exception(exc)
