"""The worker-side core (worker/core.py), which the Ray worker and the simulator's
SimWorker both run: role gating, ownership, abort tombstones and the start
handshake's rule, on the system's clock and on a simulation's virtual time."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.errors import InvalidRequestError, WorkerBusyError, WrongRoleError
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.sim import virtual_time
from pdserve.worker.core import ROLE_CALLS, WorkerCore, admit_started
from pdserve.worker.messages import ROLES, TokenDelta


def _core(role: str = "both", tombstone_s: float = 120.0) -> WorkerCore:
    return WorkerCore("w0", role, time.monotonic, tombstone_s)


@pytest.mark.parametrize("role", ROLES)
def test_each_role_takes_the_calls_it_is_listed_for_and_names_the_rest(role):
    core = _core(role)
    for call, roles in ROLE_CALLS.items():
        if role in roles:
            core.require(call)
        else:
            with pytest.raises(WrongRoleError, match=f"w0 is in role {role}: it takes no {call}"):
                core.require(call)
    core.require("abort")  # a call no role gates
    assert set(ROLE_CALLS) == {"prefill", "reserve", "take_over", "submit"}


def test_a_role_changes_only_while_the_worker_holds_nothing():
    core = _core("prefill")
    with pytest.raises(WorkerBusyError, match="still holds 2 request"):
        core.change_role("decode", holding=2)
    assert core.role == "prefill"
    with pytest.raises(InvalidRequestError) as bad:
        core.change_role("sideways", holding=0)
    assert bad.value.field == "role"
    core.change_role("decode", holding=0)
    assert core.role == "decode"
    with pytest.raises(WrongRoleError):
        core.require("prefill")


def test_a_request_belongs_to_its_subscriber_alone():
    core = _core()
    core.claim("r1", "router-a")
    with pytest.raises(InvalidRequestError) as taken:
        core.claim("r1", "router-b")  # the same id from another router
    assert taken.value.field == "request_id"
    assert core.may_abort("r1", "router-a") and not core.may_abort("r1", "router-b")
    assert core.may_abort("unknown", "router-b")  # nothing here: nobody's to protect
    core.claim("r2", "router-b")
    routed = core.route([_delta("r1", False), _delta("r2", True), _delta("r9", False)])
    assert {owner: [d.request_id for d in ds] for owner, ds in routed.items()} == {
        "router-a": ["r1"], "router-b": ["r2"], None: ["r9"]}
    assert core.owns("r1") and not core.owns("r2")  # a finished request is forgotten
    core.claim("r3", "router-a")
    assert sorted(core.orphans("router-a")) == ["r1", "r3"]  # router-a is gone
    assert core.owns("r1")  # still its own while it is being ended
    for request_id in core.orphans("router-a"):
        core.release(request_id)
    assert core.orphans("router-a") == [] and not core.owns("r1")
    core.claim("r1", "router-b")  # the id is free again


def test_a_choice_forked_on_the_worker_is_its_requests_owners():
    """n > 1: the worker forks choices the router never reserved or submitted; each
    is its request's owner's, from its first delta (which comes before its request's)
    until it finishes."""
    from pdserve.engine.request import choice_id
    core = _core()
    core.claim("r1", "router-a")
    one, two = choice_id("r1", 1), choice_id("r1", 2)
    routed = core.route([_delta(one, False), _delta(two, True), _delta("r1", True)])
    assert {owner: [d.request_id for d in ds] for owner, ds in routed.items()} == {
        "router-a": [one, two, "r1"]}
    assert core.owns(one) and not core.owns(two) and not core.owns("r1")
    assert core.orphans("router-a") == [one] and core.may_abort(one, "router-a")
    assert not core.may_abort(one, "router-b")
    assert core.route([_delta(choice_id("r7", 1), False)]) == {  # nobody's request
        None: [_delta(choice_id("r7", 1), False)]}


def _delta(rid: str, finished: bool) -> TokenDelta:
    return TokenDelta(request_id=rid, token_ids=[5], text="", logprobs=[], finished=finished)


class _SystemClock:
    """The system's monotonic clock, read as production reads it; `advance` adds to
    what it reads instead of waiting."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    async def advance(self, seconds: float) -> None:
        self.offset += seconds


class _VirtualClock:
    """A simulation's: the running loop's virtual time, which a sleep moves at once."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    async def advance(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@pytest.mark.parametrize("clock", [_SystemClock, _VirtualClock], ids=["system", "virtual"])
def test_an_abort_is_remembered_for_the_tombstone_and_then_let_go(clock):
    async def scenario():
        c = clock()
        core = WorkerCore("w0", "decode", c.monotonic, tombstone_s=120.0)
        assert not core.overtaken("r1")
        core.aborted("r1")
        assert core.overtaken("r1")  # a reservation of it that comes now is refused
        await c.advance(119.0)
        assert core.overtaken("r1")
        core.aborted("r2")
        await c.advance(1.5)
        assert not core.overtaken("r1") and core.overtaken("r2")
        core.aborted("r3")  # an abort lets expired tombstones go
        assert "r1" not in core._aborted and core.overtaken("r2")
        await c.advance(120.0)
        assert not any(core.overtaken(r) for r in ("r1", "r2", "r3"))
        return True
    assert virtual_time.run(scenario()) if clock is _VirtualClock else asyncio.run(scenario())


def _waiting(scheduler: Scheduler, rid: str, max_tokens: int, stop: list[int] = ()) -> None:
    request = Request(rid, list(range(10, 30)), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop)), 0.0)
    assert scheduler.reserve(request)


def test_the_first_token_joins_the_batch_and_may_end_the_request():
    s = Scheduler(SchedulerConfig(), BlockManager(64, 16))
    _waiting(s, "goes-on", 8)
    _waiting(s, "stop-token", 8, stop=[3])
    _waiting(s, "one-token", 1)
    going = admit_started(s, "goes-on", 5)
    assert going.status is RequestStatus.RUNNING and going.output_token_ids == [5]
    stopped = admit_started(s, "stop-token", 3)
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == 3
    assert admit_started(s, "one-token", 5).finish_reason is FinishReason.LENGTH
    assert [r.request_id for r in s.running] == ["goes-on"]
    assert s.block_manager.num_free_blocks == 64 - 2  # the ended ones' blocks are free
    with pytest.raises((KeyError, ValueError)):
        admit_started(s, "never-reserved", 5)
