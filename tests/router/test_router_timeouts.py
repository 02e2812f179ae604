"""The router's waits on workers end by their timeouts. The worker here is a stand-in
at the Ray actor boundary whose abort never answers; the real workers' abort is
exercised by the cluster tests."""
from __future__ import annotations

import asyncio
import time

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.router import ModelInfo, Router
from pdserve.router.workers import DecodeHandle


class _Method:
    def __init__(self, answers: bool):
        self.answers = answers
        self.calls = 0

    def remote(self, *args):
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        if self.answers:
            future.set_result(None)
        return future


class _HungOnAbort:
    def __init__(self):
        self.submit = _Method(answers=True)
        self.abort = _Method(answers=False)


def test_a_worker_that_never_answers_abort_does_not_hold_a_cancelled_stream():
    actor = _HungOnAbort()
    worker = DecodeHandle("engine-0", actor, num_blocks=8, free_blocks=8)
    router = Router(None, ModelInfo("m", 64, 100, 16), [], [worker],
                    RouterConfig(control_timeout_s=0.2), colocated=True)

    async def scenario() -> float:
        stream = router.generate(router.accept([1, 2, 3], SamplingParams(max_tokens=4)))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)  # submitted; waiting for a step that never comes
        assert actor.submit.calls == 1 and not first.done()
        first.cancel()  # the caller goes away
        t0 = time.monotonic()
        await asyncio.wait({first}, timeout=5)
        return time.monotonic() - t0

    elapsed = asyncio.run(scenario())
    assert actor.abort.calls == 1
    assert elapsed < 2, f"the cancelled stream waited {elapsed:.1f}s on the hung abort"
    assert worker.inflight == 0 and not worker.streams
