"""The WorkerClient of a worker actor on Ray (worker/actor.py): each call is one
actor call, Ray's failures translated at this seam so that nothing past it knows of
Ray: an actor that died or is restarting raises WorkerDied; an error the worker
raised is re-raised as itself (Ray wraps it in a RayTaskError)."""
from __future__ import annotations

import logging
from typing import AsyncIterator

import ray
from ray.exceptions import RayError, RayTaskError

from pdserve.router.errors import WorkerDied, WorkerError
from pdserve.worker.messages import (
    BlockCopy,
    IncomingCopy,
    Job,
    Paused,
    PrefillJob,
    PrefillResult,
    Reservation,
    StepBatch,
    WorkerStats,
)

log = logging.getLogger(__name__)
_DEATHS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")


class RayWorkerClient:
    def __init__(self, actor, placement=None):
        """placement: a tensor-parallel worker's placement group (its ranks' bundles,
        launch.WorkerSpawner), removed with it."""
        self.actor = actor  # a WorkerActor handle
        self.placement = placement

    async def address(self) -> str:
        return await _answer(self.actor.address.remote())

    async def connect(self, receiver_addresses: list[str]) -> None:
        await _answer(self.actor.connect.remote(receiver_addresses))

    async def disconnect(self, receiver_addresses: list[str]) -> None:
        await _answer(self.actor.disconnect.remote(receiver_addresses))

    async def reserve(self, job: Job, subscriber: str) -> Reservation | None:
        return await _answer(self.actor.reserve.remote(job, subscriber))

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        return await _answer(self.actor.prefill.remote(job))

    async def start(self, request_id: str, first_token: int, choices: list[int] = ()) -> None:
        await _answer(self.actor.start.remote(request_id, first_token, list(choices)))

    async def submit(self, job: Job, subscriber: str) -> None:
        await _answer(self.actor.submit.remote(job, subscriber))

    async def take_over(self, job: Job, subscriber: str) -> Reservation | None:
        return await _answer(self.actor.take_over.remote(job, subscriber))

    async def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        return await _answer(self.actor.expect_copy.remote(incoming))

    async def send_blocks(self, copy: BlockCopy) -> int:
        return await _answer(self.actor.send_blocks.remote(copy))

    async def pause(self, request_id: str) -> Paused | None:
        return await _answer(self.actor.pause.remote(request_id))

    async def abort(self, request_id: str, subscriber: str) -> None:
        await _answer(self.actor.abort.remote(request_id, subscriber))

    async def abort_all(self, subscriber: str) -> int:
        return await _answer(self.actor.abort_all.remote(subscriber))

    async def steps(self, stall_timeout_s: float, subscriber: str) -> AsyncIterator[StepBatch]:
        stream = self.actor.steps.remote(stall_timeout_s, subscriber)
        while True:
            try:
                batch = await (await stream.__anext__())
            except StopAsyncIteration:
                return
            except RayError as exc:
                raise translated(exc) from None
            yield batch

    async def set_role(self, role: str) -> None:
        await _answer(self.actor.set_role.remote(role))

    async def stats(self) -> WorkerStats:
        stats = await _answer(self.actor.stats.remote())
        return WorkerStats(num_blocks=stats["num_blocks"], free_blocks=stats["free_blocks"],
                           lease_expiries=stats["lease_expiries"],
                           incarnation=stats["incarnation"])

    def kill(self) -> None:
        """The worker ends for good: its actor, then its placement group (any rank
        still in it goes with it)."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # an actor long gone
            log.debug("could not kill a leaving worker: %r", exc)
        placement, self.placement = self.placement, None
        if placement is not None:
            try:
                ray.util.remove_placement_group(placement)
            except Exception as exc:  # removed already
                log.debug("could not remove a leaving worker's placement group: %r", exc)


async def _answer(ref):
    try:
        return await ref
    except RayError as exc:
        raise translated(exc) from None


def translated(exc: RayError) -> Exception:
    """Ray's failure as the router reads it: WorkerDied when the actor's process died
    or is restarting, the worker's own error when it raised one, else a WorkerError
    (Ray's text names pids, addresses and ids: none of it reaches a client)."""
    if type(exc).__name__ in _DEATHS:
        return WorkerDied("the worker died")
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RayError):
            return translated(cause)
        if isinstance(cause, Exception):
            return cause
    return WorkerError("the worker failed")
