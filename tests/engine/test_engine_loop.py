"""EngineLoop: calls run at step boundaries; call_concurrent runs beside a forward pass."""
from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import _IDLE_WAIT_S, EngineLoop
from pdserve.engine.parallel.messages import StepExport
from pdserve.engine.sampling_params import SamplingParams
from tests.polling import until


@pytest.fixture
def engine(llama_dir):
    return LLMEngine(EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=4 << 20))


class _HeldForwardPass:
    """An export hook that holds the forward pass at layer 0 until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, out):
        def on_layer(layer: int) -> None:
            if layer == 0:
                self.entered.set()
                assert self.release.wait(30), "the test never released the forward pass"
        return StepExport(send=on_layer)


def test_call_runs_between_steps_and_returns_its_result_or_error(engine):
    loop = EngineLoop(engine, on_step=lambda outputs: None)
    try:
        assert loop.call(lambda e: e.block_manager.num_blocks).result(10) > 0
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda e: 1 / 0).result(10)
    finally:
        loop.stop()


def test_a_reservation_does_not_wait_for_the_forward_pass_in_flight(engine):
    held = _HeldForwardPass()
    steps = []
    loop = EngineLoop(engine, on_step=steps.append, export=held)
    try:
        loop.call(lambda e: e.add_request("running", list(range(5, 40)),
                                          SamplingParams(max_tokens=4, temperature=0)))
        assert held.entered.wait(30)
        at_boundary = loop.call(lambda e: e.block_manager.num_free_blocks)
        free_before = engine.block_manager.num_free_blocks
        request = loop.call_concurrent(lambda e: e.reserve_remote(
            "remote", list(range(50, 90)), SamplingParams(max_tokens=4, temperature=0)))
        # The reservation is done while the step is still held; a boundary call is not.
        block_size = engine.block_manager.block_size
        assert request is not None and len(request.block_ids) == -(-40 // block_size)
        assert engine.block_manager.num_free_blocks == free_before - len(request.block_ids)
        assert not at_boundary.done() and not steps
        held.release.set()
        at_boundary.result(30)
        while not any(o.finished for batch in steps for o in batch):
            loop.call(lambda e: None).result(30)
        finished = [o for batch in steps for o in batch if o.finished]
        assert [o.request_id for o in finished] == ["running"]  # "remote" waits for its KV
    finally:
        held.release.set()
        loop.stop()


def test_a_waiting_request_that_cannot_be_admitted_does_not_spin_the_loop(llama_dir):
    """Every block reserved for KV still arriving and a request waiting: each step
    schedules nothing. The loop waits between such steps (a wake-up or the idle
    wait) instead of calling step() back to back, which would starve the threads
    that land KV and free the blocks."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(llama_dir), num_kv_blocks=8))
    size = 8 * engine.block_manager.block_size - 1  # every block
    assert engine.reserve_remote("holds-all", list(range(5, 5 + size)),
                                 SamplingParams(max_tokens=1)) is not None
    engine.add_request("waits", list(range(5, 40)), SamplingParams(max_tokens=2))
    calls = []
    step = engine.step

    def counted(*args, **kwargs):
        calls.append(time.monotonic())
        return step(*args, **kwargs)
    engine.step = counted
    loop = EngineLoop(engine, on_step=lambda outputs: None)
    try:
        assert until(lambda: len(calls) >= 5, timeout_s=30, every_s=0.01)
        assert calls[4] - calls[0] >= 3 * _IDLE_WAIT_S  # four waits between five steps
    finally:
        loop.stop()
