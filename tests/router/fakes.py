"""Stand-ins for worker actors at the Ray boundary, for router tests: each call
returns an asyncio future the test resolves (or never does). The real actors behind
this boundary are exercised by the cluster tests."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from pdserve.engine.worker_messages import (
    PrefillResult,
    Reservation,
    StepBatch,
    TokenDelta,
    WorkerTelemetry,
)
from pdserve.router.workers import WorkerHandle


class _Method:
    def __init__(self, actor: "FakeActor", name: str):
        self.actor, self.name = actor, name

    def remote(self, *args):
        future = asyncio.get_running_loop().create_future()
        self.actor.calls[self.name].append((args, future))
        answer = self.actor.answers.get(self.name)
        if answer is not None:
            answer(future, *args)
        self.actor.called.set()
        return future


class FakeActor:
    """`answers[name](future, *args)` may resolve a call at once; unanswered calls
    stay pending in `calls[name]` for the test to resolve."""

    def __init__(self, **answers):
        self.calls: dict[str, list] = defaultdict(list)
        self.answers = answers
        self.called = asyncio.Event()
        self.batches: asyncio.Queue = asyncio.Queue()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    @property
    def steps(self):
        actor = self

        class _Steps:
            def remote(self, stall_timeout_s, subscriber=""):
                return _StepStream(actor.batches)
        return _Steps()

    def ids(self, name: str) -> list[str]:
        return [args[0] if not hasattr(args[0], "request_id") else args[0].request_id
                for args, _ in self.calls[name]]

    async def wait_call(self, name: str, count: int = 1) -> None:
        while len(self.calls[name]) < count:
            self.called.clear()
            await self.called.wait()


class _StepStream:
    def __init__(self, batches: asyncio.Queue):
        self.batches = batches

    async def __anext__(self):
        item = await self.batches.get()
        if isinstance(item, Exception):
            raise item
        done = asyncio.get_running_loop().create_future()
        done.set_result(item)
        return done


def resolve(value):
    return lambda future, *args: future.set_result(value)


def reserve_ok(worker_address: str = "fake:0"):
    def answer(future, request_id, prompt, params, arrival, subscriber=""):
        blocks = list(range(-(-(len(prompt) + 1) // 16)))
        future.set_result(Reservation(request_id, worker_address, blocks, 0))
    return answer


def prefill_ok(first_token: int):
    def answer(future, job):
        future.set_result(PrefillResult(job.request_id, first_token, None, None, 0, 0.01))
    return answer


def batch(worker_id: str, request_id: str, tokens: list[int], text: str,
          finish: str | None = None) -> StepBatch:
    return StepBatch(worker_id, [TokenDelta(request_id, tokens, text, [], finish is not None,
                                            finish)])


def telemetry(worker_id: str, role: str, free_blocks: int, num_blocks: int = 100,
              running: int = 0) -> WorkerTelemetry:
    return WorkerTelemetry(worker_id, role, 0.0, 0, 0, running, 0, 0, free_blocks,
                           num_blocks, 0)


def worker(worker_id: str, actor: FakeActor, role: str, free_blocks: int | None = None,
           num_blocks: int = 100) -> WorkerHandle:
    """A handle on a stand-in actor; with free_blocks, as if it had just reported."""
    handle = WorkerHandle(worker_id, actor, role, num_blocks=num_blocks)
    if free_blocks is not None:
        handle.heard(telemetry(worker_id, role, free_blocks, num_blocks))
    return handle
