"""RouterServer.stop when the drain does not end: it is bounded, says what still runs,
and stops the loop anyway (a `pdserve` process must not outlive its drain silently)."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.front.server import RouterServer
from pdserve.router.model_info import ModelInfo
from pdserve.router.router import Router
from tests.router.fakes import FakeWorker, worker


def test_a_drain_that_does_not_end_is_reported_with_what_still_runs(llama_dir, caplog):
    engine = worker("engine-0", FakeWorker(), "both", free_blocks=8, num_blocks=8)
    router = Router(Tokenizer(llama_dir), ModelInfo("m", 64, 100, 16), [engine],
                    RouterConfig())

    async def a_stop_that_never_returns() -> None:
        await asyncio.Event().wait()
    router.stop = a_stop_that_never_returns
    srv = RouterServer(router)
    srv.stop_margin_s = 0.5
    with caplog.at_level(logging.ERROR), pytest.raises(TimeoutError):
        srv.stop(grace_s=0.1)
    assert "the drain did not end within 0.6 s" in caplog.text
    assert "a_stop_that_never_returns" in caplog.text
    assert not srv._thread.is_alive()


def test_a_drain_stuck_in_a_call_that_blocks_the_loop_says_so(llama_dir, caplog):
    engine = worker("engine-0", FakeWorker(), "both", free_blocks=8, num_blocks=8)
    router = Router(Tokenizer(llama_dir), ModelInfo("m", 64, 100, 16), [engine],
                    RouterConfig())
    release = threading.Event()

    async def a_stop_that_blocks_the_thread() -> None:
        release.wait(30)  # a synchronous call: the loop runs nothing meanwhile
    router.stop = a_stop_that_blocks_the_thread

    class Release(logging.Handler):  # the report made: the call may return
        def emit(self, record) -> None:
            release.set()
    reported = Release(logging.ERROR)
    logging.getLogger("pdserve.router.front.server").addHandler(reported)
    srv = RouterServer(router)
    srv.stop_margin_s = 0.5
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(TimeoutError):
            srv.stop(grace_s=0.1)
    finally:
        release.set()
        logging.getLogger("pdserve.router.front.server").removeHandler(reported)
    assert "nothing answers: a call blocks the loop's thread" in caplog.text
    assert not srv._thread.is_alive()
