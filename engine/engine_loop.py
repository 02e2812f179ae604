"""An LLMEngine on its own thread. Other threads submit calls, which run between
steps, and receive every step's outputs as one batch. The one exception,
call_concurrent, runs a call on the caller's thread while a forward pass may be in
flight, under the lock the loop holds whenever scheduler state changes."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

from pdserve.engine.engine import KVExport, LLMEngine
from pdserve.engine.outputs import RequestOutput

T = TypeVar("T")
_IDLE_WAIT_S = 0.05
log = logging.getLogger(__name__)


def exit_for_restart(error: BaseException) -> None:
    """An on_death for a worker process that Ray restarts (max_restarts): the loop's
    error is logged and the process exits at once, so a fresh one takes its place
    instead of a live-looking process that fails every request."""
    log.critical("engine loop died, exiting for a restart: %r", error, exc_info=error)
    logging.shutdown()
    os._exit(70)  # EX_SOFTWARE


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None],
                 export: KVExport | None = None,
                 on_death: Callable[[BaseException], None] | None = None):
        """on_death(error) runs on the loop's thread after a step raised (an error the
        engine could not pin on particular requests) and pending calls failed."""
        self.engine = engine
        self.on_step = on_step
        self.export = export
        self.on_death = on_death
        self.error: BaseException | None = None
        self.progress_at = time.monotonic()  # when the loop last finished a step or an idle wait
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Runs fn(engine) at the next step boundary; its result or error lands in the
        returned future."""
        future: Future = Future()
        if self.error is not None:
            future.set_exception(RuntimeError(f"engine loop stopped: {self.error!r}"))
            return future
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def call_concurrent(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) now on this thread, waiting only for a schedule or update in
        progress, not for the forward pass. Only for calls that touch scheduler and
        block-manager state and none of the running batch (reserving blocks for a
        remote prefill): a decode step takes tens of ms, a reservation microseconds."""
        if self.error is not None:
            raise RuntimeError(f"engine loop stopped: {self.error!r}")
        with self._state_lock:
            return fn(self.engine)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._state_lock:
                    self._run_calls()
                outputs, ran = [], False
                if self.engine.has_work():
                    steps = self.engine.num_steps
                    outputs = self.engine.step(self.export, self._state_lock)
                    ran = self.engine.num_steps != steps
                    if outputs:
                        self.on_step(outputs)
                if not (ran or outputs):
                    # Idle, or waiting requests that fit nowhere until KV lands or a
                    # call frees blocks: never spin, it would starve the KV threads.
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                self.progress_at = time.monotonic()
        except BaseException as exc:  # a bug in a step: fail loudly, never hang callers
            self.error = exc
            with self._state_lock:
                self._run_calls()
            if self.on_death is not None:
                self.on_death(exc)
            raise

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get()
            if self.error is not None:
                future.set_exception(RuntimeError(f"engine loop stopped: {self.error!r}"))
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)
