"""A WorkerClient stand-in for router tests that need to hold a worker's answers:
each call returns a future the test resolves (or never does). The real clients
behind this seam are tested too: RayWorkerClient by the cluster tests, the
simulated worker by tests/sim."""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from pdserve.router.pool.workers import WorkerHandle
from pdserve.worker.messages import (
    PrefillResult,
    Reservation,
    StepBatch,
    TokenDelta,
    WorkerTelemetry,
)


class FakeWorker:
    """`answers[name](future, *args)` may resolve a call at once; unanswered calls
    stay pending in `calls[name]` for the test to resolve. `batches` feeds steps()."""

    def __init__(self, **answers):
        self.calls: dict[str, list] = defaultdict(list)
        self.answers = answers
        self.called = asyncio.Event()
        self.batches: asyncio.Queue = asyncio.Queue()
        self.killed = False

    def _call(self, name: str, *args):
        future = asyncio.get_running_loop().create_future()
        self.calls[name].append((args, future))
        answer = self.answers.get(name)
        if answer is not None:
            answer(future, *args)
        self.called.set()
        return future

    async def address(self):
        return await self._call("address")

    async def connect(self, receiver_addresses):
        return await self._call("connect", receiver_addresses)

    async def disconnect(self, receiver_addresses):
        return await self._call("disconnect", receiver_addresses)

    async def reserve(self, job, subscriber):
        return await self._call("reserve", job, subscriber)

    async def prefill(self, job):
        return await self._call("prefill", job)

    async def start(self, request_id, first_token, choices=()):
        return await self._call("start", request_id, first_token, list(choices))

    async def submit(self, job, subscriber):
        return await self._call("submit", job, subscriber)

    async def abort(self, request_id, subscriber):
        return await self._call("abort", request_id, subscriber)

    async def set_role(self, role):
        return await self._call("set_role", role)

    async def stats(self):
        return await self._call("stats")

    def kill(self) -> None:
        self.killed = True

    async def steps(self, stall_timeout_s, subscriber):
        while True:
            item = await self.batches.get()
            if isinstance(item, Exception):
                raise item
            yield item

    def ids(self, name: str) -> list[str]:
        return [args[0] if not hasattr(args[0], "request_id") else args[0].request_id
                for args, _ in self.calls[name]]

    async def wait_call(self, name: str, count: int = 1) -> None:
        while len(self.calls[name]) < count:
            self.called.clear()
            await self.called.wait()


def resolve(value):
    return lambda future, *args: future.set_result(value)


def reserve_ok(worker_address: str = "fake:0"):
    def answer(future, job, subscriber=""):
        blocks = list(range(-(-(len(job.prompt_token_ids) + 1) // 16)))
        future.set_result(Reservation(request_id=job.request_id,
                                      receiver_address=worker_address, block_ids=blocks,
                                      num_cached_blocks=0))
    return answer


def prefill_ok(first_token: int, choices: tuple[int, ...] = ()):
    """choices: n > 1, the first tokens of choices 1 .. n-1 drawn with first_token."""
    def answer(future, job):
        future.set_result(PrefillResult(request_id=job.request_id, first_token=first_token,
                                        first_logprob=None, first_top_logprobs=None,
                                        kv_bytes_sent=0, prefill_seconds=0.01,
                                        choices=[(t, None, None) for t in choices]))
    return answer


def batch(worker_id: str, request_id: str, tokens: list[int], text: str,
          finish: str | None = None) -> StepBatch:
    return StepBatch(worker_id=worker_id, deltas=[TokenDelta(
        request_id=request_id, token_ids=tokens, text=text, logprobs=[],
        finished=finish is not None, finish_reason=finish)])


def telemetry(worker_id: str, role: str, free_blocks: int, num_blocks: int = 100,
              running: int = 0) -> WorkerTelemetry:
    return WorkerTelemetry(worker_id=worker_id, role=role, time=0.0, waiting=0,
                           waiting_tokens=0, running=running, context_tokens=0, reserved=0,
                           free_blocks=free_blocks, num_blocks=num_blocks,
                           num_preemptions=0)


def reported(worker_id: str, role: str, free_blocks: int) -> StepBatch:
    """A batch carrying only a telemetry report."""
    return StepBatch(worker_id=worker_id, deltas=[],
                     telemetry=telemetry(worker_id, role, free_blocks))


def worker(worker_id: str, client: FakeWorker, role: str, free_blocks: int | None = None,
           num_blocks: int = 100) -> WorkerHandle:
    """A handle on a stand-in worker; with free_blocks, as if it had just reported."""
    handle = WorkerHandle.of(worker_id, client, role, num_blocks=num_blocks)
    if free_blocks is not None:
        handle.update(telemetry=telemetry(worker_id, role, free_blocks, num_blocks),
                      heard_at=time.monotonic())
    return handle
