"""What every worker does the same way whatever runs it: the Ray actor over a real
engine (worker.py, actor.py) and the simulator's SimWorker in virtual time
(pdserve/sim/worker.py). Declared once here and tested once, on both clocks
(tests/workers/test_core.py):

- role gating: which calls each role takes (ROLE_CALLS), and a role change, refused
  while the worker holds a request;
- ownership: each request belongs to the subscriber (a router) that reserved or
  submitted it; only its owner may abort it, its deltas go to its owner alone, and a
  subscriber that is gone leaves orphans to end;
- tombstones: an abort may overtake the reservation it cancels, so an aborted id is
  remembered for `tombstone_s` (the KV begin lease: no reservation is older) and a
  later reservation of it refused;
- the start handshake's rule (`admit_started`): the first token joins the request to
  the batch, and may already end it.

Pure: no Ray, no threads, no event loop; time is a clock passed in (monotonic
seconds: the system's, or a simulation's virtual time)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdserve.engine.errors import InvalidRequestError, WorkerBusyError, WrongRoleError
from pdserve.engine.request import Request, parent_of
from pdserve.engine.scheduler import Scheduler
from pdserve.worker.messages import ROLES, TokenDelta, check_role

# The calls a role gates, and the roles that take each; every other call any role takes.
ROLE_CALLS: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill", "both"),
    "reserve": ("decode", "both"),
    "take_over": ("decode", "both"),
    "submit": ("both",),
}
assert {r for roles in ROLE_CALLS.values() for r in roles} <= set(ROLES)


class WorkerCore:
    def __init__(self, worker_id: str, role: str, monotonic: Callable[[], float],
                 tombstone_s: float):
        check_role(role)
        if tombstone_s < 0:
            raise ValueError("tombstone_s must be >= 0")
        self.worker_id = worker_id
        self.role = role
        self._monotonic = monotonic
        self._tombstone_s = tombstone_s
        self._owners: dict[str, str] = {}  # request id -> its subscriber
        self._aborted: dict[str, float] = {}  # request id -> when its abort arrived

    # ---- roles ----------------------------------------------------------------------

    def require(self, call: str) -> None:
        """Raises WrongRoleError when the worker's role does not take `call`."""
        roles = ROLE_CALLS.get(call)
        if roles is not None and self.role not in roles:
            raise WrongRoleError(f"worker {self.worker_id} is in role {self.role}: it "
                                 f"takes no {call}")

    def change_role(self, role: str, holding: int) -> None:
        """The new role, unless the worker holds `holding` > 0 requests (drain first)."""
        check_role(role)
        if holding:
            raise WorkerBusyError(f"worker {self.worker_id} still holds {holding} "
                                  f"request(s); drain it first")
        self.role = role

    # ---- ownership ------------------------------------------------------------------

    def check_unclaimed(self, request_id: str) -> None:
        """An id a request here holds is refused, whoever asks: it is its owner's."""
        if request_id in self._owners:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use "
                                      "on this worker")

    def claim(self, request_id: str, subscriber: str) -> None:
        """The request is the subscriber's from now (check_unclaimed first)."""
        self.check_unclaimed(request_id)
        self._owners[request_id] = subscriber

    def release(self, request_id: str) -> None:
        """Nothing started for it here (or it ended without a delta)."""
        self._owners.pop(request_id, None)

    def owns(self, request_id: str) -> bool:
        return request_id in self._owners

    def may_abort(self, request_id: str, subscriber: str) -> bool:
        """Another subscriber's request of the same id is not this caller's to end."""
        owner = self._owners.get(request_id)
        return owner is None or owner == subscriber

    def orphans(self, subscriber: str) -> list[str]:
        """The requests of a subscriber that is gone (still its own: each is released
        as it is ended, so no other subscriber takes an id that is still ending)."""
        return [r for r, owner in self._owners.items() if owner == subscriber]

    def route(self, deltas: Iterable[TokenDelta]) -> dict[str, list[TokenDelta]]:
        """Each delta under its request's owner (None: nobody's); a finished request is
        forgotten."""
        by_owner: dict[str, list[TokenDelta]] = {}
        owners = self._owners
        for delta in deltas:
            rid = delta.request_id
            if rid not in owners and (parent := parent_of(rid)) in owners:
                owners[rid] = owners[parent]  # a choice forked from it (n > 1): its owner's
            owner = owners.pop(rid, None) if delta.finished else owners.get(rid)
            by_owner.setdefault(owner, []).append(delta)
        return by_owner

    # ---- tombstones -----------------------------------------------------------------

    def aborted(self, request_id: str) -> None:
        """Its abort arrived: a reservation of it that comes later is refused until
        `tombstone_s` has passed (older tombstones are let go now)."""
        now = self._monotonic()
        self._aborted[request_id] = now
        expired = [r for r, at in self._aborted.items() if now - at >= self._tombstone_s]
        for rid in expired:
            if rid != request_id:
                del self._aborted[rid]

    def overtaken(self, request_id: str) -> bool:
        """An abort of this id arrived within `tombstone_s`: refuse its reservation."""
        at = self._aborted.get(request_id)
        return at is not None and self._monotonic() - at < self._tombstone_s


def admit_started(scheduler: Scheduler, request_id: str, first_token: int,
                  choices: Sequence[int] = ()) -> Request:
    """The start handshake, once the request's KV landed: it joins the batch after
    its first token (sampled where it was prefilled), which may already end it (a stop
    token, or max_tokens 1); choices: n > 1, its other choices' first tokens (drawn
    there too), forked here (Scheduler.take_forked). KeyError / ValueError: it is not
    waiting here."""
    request = scheduler.admit_prefilled(request_id, first_token, choices)
    reason = request.check_stop()
    if reason is not None:
        scheduler.finish_requests([request_id], reason)
    return request
