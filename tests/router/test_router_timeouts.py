"""The router's waits on workers end by their timeouts. The worker here is a stand-in
at the Ray actor boundary whose abort never answers; the real workers' abort is
exercised by the cluster tests."""
from __future__ import annotations

import asyncio
import time

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.router import Router
from tests.router.fakes import FakeWorker, resolve, worker


def test_a_worker_that_never_answers_abort_does_not_hold_a_cancelled_stream(llama_dir):
    async def scenario() -> tuple:
        actor = FakeWorker(submit=resolve(None))  # abort never answers
        engine = worker("engine-0", actor, "both", free_blocks=8, num_blocks=8)
        router = Router(Tokenizer(llama_dir), ModelInfo("m", 64, 100, 16), [engine],
                        RouterConfig(control_timeout_s=0.2))
        stream = router.generate(await router.accept([1, 2, 3], SamplingParams(max_tokens=4)))
        first = asyncio.ensure_future(stream.__anext__())
        await actor.wait_call("submit")  # submitted; waiting for a step that never comes
        assert not first.done()
        first.cancel()  # the caller goes away
        t0 = time.monotonic()
        await asyncio.wait({first}, timeout=5)
        elapsed = time.monotonic() - t0
        await router.stop()  # its abort call times out within control_timeout_s
        return elapsed, actor, engine

    elapsed, actor, engine = asyncio.run(scenario())
    assert len(actor.calls["abort"]) == 1
    assert elapsed < 2, f"the cancelled stream waited {elapsed:.1f}s on the hung abort"
    assert engine.state.inflight == 0 and not engine.flights
