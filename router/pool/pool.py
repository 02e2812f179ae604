"""The workers this router serves with: live membership.

A worker joins paired and subscribed, drains, changes role (its weights stay loaded)
and leaves once this router's requests on it are done (moved off live, when a mover
is set). Workers are paired as they join, change role or come back, and their pairs
closed as they leave (pairing.py). Every call to a worker goes through its
WorkerClient. Deaths, stalls, revivals and evictions: supervision.py.

Every change this pool makes is recorded in its registry (pool_registry.py); with
other router replicas over the same workers, their changes are applied here
(replicas/follower.py). A drain then waits for every replica's requests on the worker
(its own reports say when it holds none), and of the replicas that see a worker
evicted only one replaces it (`may_replace`)."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Awaitable, Callable

from pdserve.router.config import RouterConfig
from pdserve.router.errors import short_reason
from pdserve.router.pool.pairing import Pairing
from pdserve.router.pool.spawner import KEPT_FAILURES, Joining, Progress, Spawner
from pdserve.router.pool.supervision import Supervision
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.follower import ReplicaFollower
from pdserve.router.replicas.pool_registry import LocalRegistry, PoolRegistry, WorkerEntry
from pdserve.worker.messages import check_role

log = logging.getLogger(__name__)

Hook = Callable[[WorkerHandle], None]


class MembershipError(RuntimeError):
    """An admin call that cannot be carried out (unknown worker, no spawner, a worker
    that would not drain in time); `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


class Pool:
    def __init__(self, config: RouterConfig, subscriber: str, spawner: Spawner | None = None,
                 on_report=None, on_leave: Hook | None = None,
                 on_restart: Hook | None = None, registry: PoolRegistry | None = None,
                 may_replace: Callable[[], bool] = lambda: True):
        """subscriber: this router's name to the workers (they stream it its own
        requests only). on_report(worker, telemetry) hears every report; on_leave a
        worker that left; on_restart one whose process was replaced (what was learned
        of the old one no longer holds). registry: where the replicas over these
        workers share their membership (default: none, this router alone);
        may_replace(): whether this replica replaces an evicted worker (one does)."""
        self.config = config
        self.subscriber = subscriber
        self.spawner = spawner
        self.on_report = on_report or (lambda worker, telemetry: None)
        self.on_leave = on_leave or (lambda worker: None)
        self.on_restart = on_restart or (lambda worker: None)
        self.workers: dict[str, WorkerHandle] = {}
        self.joining: dict[str, Joining] = {}  # being added, or failed to be (the last few)
        self._spawns: dict[str, asyncio.Task] = {}  # worker id -> its addition under way
        # Seconds from asked for to serving, of the last workers added.
        self.startup_times: deque[float] = deque(maxlen=8)
        self.on_change: list[Callable[[], None]] = []  # a worker left or rejoined service
        # Eviction timers of silent workers and fresh workers for evicted ones.
        self._background: set[asyncio.Task] = set()
        self._started = False
        self.supervision = Supervision(self)  # deaths, stalls, revivals, evictions
        self.replicas = ReplicaFollower(self)  # changes other replicas make
        self.pairing = Pairing(self.workers, config, on_dead=self.supervision.died)
        self.closing = asyncio.Event()  # set by close(): the router is shutting down
        self.registry = registry or LocalRegistry()
        self.may_replace = may_replace
        self._idle: dict[str, tuple[float, asyncio.Event]] = {}  # drains awaiting reports
        # evacuate(worker, drained): moves this router's running requests off a
        # draining worker (live_move.LiveMover.evacuate); None: a drain waits for them
        self.evacuate: Callable[[WorkerHandle, asyncio.Event], Awaitable[None]] | None = None

    def admit(self, worker: WorkerHandle) -> None:
        """A worker paired already (launch pairs the first ones before traffic)."""
        self.workers[worker.worker_id] = worker

    @property
    def prefill(self) -> dict[str, WorkerHandle]:
        """The prefill pool: workers in role prefill."""
        return {k: w for k, w in self.workers.items() if w.state.role == "prefill"}

    @property
    def decode(self) -> dict[str, WorkerHandle]:
        """Workers that run requests' decode: roles decode and both."""
        return {k: w for k, w in self.workers.items() if w.state.decodes}

    @property
    def ready(self) -> bool:
        """Whether a request could be placed now: a worker in role both, or a prefill
        and a decode worker, in service."""
        live = [w.state for w in self.workers.values() if w.state.available]
        return any(w.role == "both" for w in live) or (
            any(w.role == "prefill" for w in live) and any(w.decodes for w in live))

    def census(self) -> dict[tuple[str, str], int]:
        """How many workers are in each (role, state): `states()`, and those being
        added ("pending", "starting")."""
        counts: dict[tuple[str, str], int] = {}
        for worker_id, state in self.states().items():
            key = (self.workers[worker_id].state.role, state)
            counts[key] = counts.get(key, 0) + 1
        for worker_id, joining in self.joining.items():
            if joining.state != "failed" and worker_id not in self.workers:
                key = (joining.role, joining.state)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def states(self) -> dict[str, str]:
        """Every worker's id -> "serving", "draining", "stalled" (no step or report
        for telemetry_stale_s: no new requests; past the stall bound its requests
        fail too), "restarting" (its process died and is being restarted) or "dead"
        (given up; evicted soon)."""
        def state(w: WorkerHandle) -> str:
            if w.worker_id in self.supervision.reviving:
                return "restarting"
            if w.state.alive and not w.state.silent:
                return "draining" if w.state.draining else "serving"
            if w.state.alive:
                return "stalled"  # silent: no new requests until it reports again
            return "stalled" if w.pump is not None and not w.pump.done() else "dead"
        return {w.worker_id: state(w) for w in self.workers.values()}

    async def start(self, record=None) -> None:
        """Subscribes to every worker and begins following the registry. record: the
        pool's PoolRecord when this router launched it (it registers the pool), None
        when it joins one registered already (or shares nothing)."""
        self._started = True
        for worker in self.workers.values():
            self.subscribe(worker)
        await self.registry.start(record, [self.entry(w) for w in self.workers.values()],
                                  self.replicas.apply, self.replicas.replica_gone)
        if self.registry.shared:
            self.in_background(self.replicas.keep_alive())

    def close(self) -> None:
        """The router is shutting down: membership operations under way end now (the
        admin API answers them 503) and none starts."""
        self.closing.set()

    async def stop(self) -> bool:
        """Stops supervising and following; True when no other replica serves these
        workers any more (whoever stops the last router ends them)."""
        self.close()
        self.supervision.stop()
        for task in self._background:
            task.cancel()
        for worker in self.workers.values():
            worker.stop_pump()
        return await self.registry.stop()

    def entry(self, worker: WorkerHandle) -> WorkerEntry:
        """The worker as the registry records it."""
        return WorkerEntry(worker_id=worker.worker_id, role=worker.state.role,
                           draining=worker.state.draining, locator=worker.locator,
                           address=worker.address, num_blocks=worker.state.num_blocks,
                           generation=worker.generation)

    # ---- membership -----------------------------------------------------------------

    async def add(self, role: str, wait: bool = True) -> str:
        """Spawns a worker of `role`, pairs it and subscribes to it, then gives it
        traffic. Returns its id once it is in service, or (wait=False) as soon as it
        is named: `joining` shows it meanwhile, and why, if it is abandoned. A
        refusal the spawner makes at once (no node could ever hold it) raises
        either way."""
        check_role(role)
        if self.spawner is None:
            raise MembershipError("this router cannot spawn workers", 501)
        named: asyncio.Future = asyncio.get_running_loop().create_future()

        def progress(worker_id: str, state: str) -> None:
            entry = self.joining.get(worker_id)
            if entry is None:
                self.joining[worker_id] = Joining(worker_id=worker_id, role=role,
                                                  state=state, since=self.now())
                self._spawns[worker_id] = spawn
                spawn.add_done_callback(lambda _: self._spawns.pop(worker_id, None))
                self._tell_wanted()
            else:
                entry.state = state
            if not named.done():
                named.set_result(worker_id)
        spawn = self.in_background(self._spawn(role, progress))
        if wait:
            return await spawn
        spawn.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged there
        await asyncio.wait({named, spawn}, return_when=asyncio.FIRST_COMPLETED)
        return named.result() if named.done() else spawn.result()

    async def _spawn(self, role: str, progress: Progress) -> str:
        names: list[str] = []

        def named(worker_id: str, state: str) -> None:
            names.append(worker_id)
            progress(worker_id, state)
        try:
            worker = await self.spawner(role, named)
            await self.join(worker)
        except asyncio.CancelledError:
            for worker_id in names:
                self.joining.pop(worker_id, None)
            self._tell_wanted()
            raise
        except Exception as exc:
            for worker_id in dict.fromkeys(names):
                log.error("worker %s (%s) was not added: %s", worker_id, role,
                          short_reason(exc))
                self._failed(worker_id, short_reason(exc))
            self._tell_wanted()
            raise
        entry = self.joining.pop(worker.worker_id, None)
        if entry is not None:
            self.startup_times.append(self.now() - entry.since)
        self._tell_wanted()  # a member now, no longer also counted as joining
        return worker.worker_id

    def _failed(self, worker_id: str, reason: str) -> None:
        entry = self.joining.get(worker_id)
        if entry is not None:
            entry.state, entry.error = "failed", reason
        failed = [k for k, e in self.joining.items() if e.state == "failed"]
        for stale in failed[:-KEPT_FAILURES]:
            del self.joining[stale]

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def join(self, worker: WorkerHandle) -> None:
        """Puts a loaded worker into service: paired with every worker of the other
        side (off the engine threads, before any traffic), subscribed, then chosen."""
        if worker.worker_id in self.workers:
            raise MembershipError(f"worker {worker.worker_id} is already a member")
        worker.update(draining=True)  # no traffic until paired and subscribed
        self.admit(worker)
        await self.pairing.join(worker)
        self.subscribe(worker)
        worker.update(draining=False)
        worker.serving_since = self.now()
        log.warning("worker %s (%s) joined", worker.worker_id, worker.state.role)
        self.registry.changed(self.entry(worker))
        self.changed()

    async def drain(self, worker_id: str, timeout_s: float | None = None) -> None:
        """Stops new work on the worker and waits until this router's requests on it
        are done. It stays a member, draining, until resumed, re-roled or removed.
        Raises MembershipError (504) if they are not done within timeout_s; it stays
        draining then."""
        worker = self.member(worker_id)
        drained = worker.drain()
        since = self.now()
        self.registry.changed(self.entry(worker))
        self.changed()
        timeout_s = self.config.worker_drain_timeout_s if timeout_s is None else timeout_s
        moving = (asyncio.ensure_future(self.evacuate(worker, drained))
                  if self.evacuate is not None and worker.state.decodes else None)
        try:
            await asyncio.wait_for(self._drained(worker, drained, since,
                                                 settled=moving is not None), timeout_s)
        except asyncio.TimeoutError:
            held = worker.state.inflight + worker.state.queued
            raise MembershipError(
                f"worker {worker_id} still holds {held} request(s) after {timeout_s:g}s"
                if held else f"worker {worker_id} still holds other routers' requests "
                f"after {timeout_s:g}s", 504) from None
        finally:
            self._idle.pop(worker_id, None)
            if moving is not None:
                moving.cancel()

    async def _drained(self, worker: WorkerHandle, drained: asyncio.Event,
                       since: float, settled: bool = False) -> None:
        """This router's requests on the worker are done and, with other replicas (or,
        settled, when they moved off it: their copies there end a moment later), the
        worker reported holding none (a report made after the drain was recorded)."""
        await drained.wait()
        if not self.registry.shared and not settled:
            return
        idle = asyncio.Event()
        self._idle[worker.worker_id] = (since, idle)
        await idle.wait()

    def reported(self, worker: WorkerHandle) -> None:
        """A report from the worker arrived (its state carries it): a drain that waits
        for the worker to hold no request hears it."""
        waiting = self._idle.get(worker.worker_id)
        t = worker.state.telemetry
        if waiting is not None and t is not None and worker.state.heard_at >= waiting[0] \
                and t.running == 0 and t.waiting == 0 and t.reserved == 0:
            waiting[1].set()

    def resume(self, worker_id: str) -> None:
        """A drained (or draining) worker takes new requests again."""
        worker = self.member(worker_id)
        worker.update(draining=False)
        self.registry.changed(self.entry(worker))
        self.changed()

    async def set_role(self, worker_id: str, role: str) -> None:
        """Drains the worker, changes its role (its weights stay loaded), pairs it for
        the new role and resumes it."""
        check_role(role)
        worker = self.member(worker_id)
        await self.drain(worker_id)
        try:
            await asyncio.wait_for(worker.client.set_role(role), self.config.control_timeout_s)
        except Exception as exc:
            raise MembershipError(f"worker {worker_id} could not change role: "
                                  f"{short_reason(exc)}") from None
        stopped_decoding = worker.state.decodes
        worker.update(role=role)
        if stopped_decoding and not worker.state.decodes:
            await self.pairing.leave(worker, worker.address)
        await self.pairing.join(worker)
        worker.serving_since = self.now()
        self.resume(worker_id)
        log.warning("worker %s is now in role %s", worker_id, role)

    async def remove(self, worker_id: str, timeout_s: float | None = None,
                     kill: bool = True) -> None:
        """Drains the worker, then it leaves: unsubscribed, forgotten and (kill) ended.
        One still being added is given up (its actor ended)."""
        spawn = self._spawns.get(worker_id)
        if worker_id not in self.workers and spawn is not None:
            spawn.cancel()
            await asyncio.wait({spawn})
            return
        worker = self.member(worker_id)
        if worker.state.alive:
            await self.drain(worker_id, timeout_s)
        unpaired = self.leave(worker, kill)
        if unpaired is not None:
            await unpaired  # it has left already; its pairs are closed by the time this returns

    def member(self, worker_id: str) -> WorkerHandle:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise MembershipError(f"no worker {worker_id!r}", 404)
        return worker

    def subscribe(self, worker: WorkerHandle) -> None:
        """Streams the worker's steps and reports to this router, once it has started
        (start() subscribes every member then)."""
        if self._started:
            worker.start_pump(self.config.stall_timeout_s, self.subscriber, self._reported,
                              self.supervision.died, self.supervision.stalled,
                              self.config.telemetry_stale_s)

    def spawning(self, worker_id: str) -> bool:
        """Whether this router is adding the worker (its spawn is under way)."""
        return worker_id in self._spawns

    def _reported(self, worker: WorkerHandle, telemetry) -> None:
        self.on_report(worker, telemetry)  # looked up per report: a hook may be replaced
        self.reported(worker)

    def leave(self, worker: WorkerHandle, kill: bool, here: bool = True
              ) -> asyncio.Task | None:
        """Returns the closing of the pairs with it, which goes on in the background.
        here False: it left through another replica, which closed its pairs."""
        worker.stop_pump()
        self.supervision.forget(worker.worker_id)
        self.workers.pop(worker.worker_id, None)
        unpaired = (self.in_background(self.pairing.leave(worker, worker.address))
                    if worker.address and here else None)
        self.on_leave(worker)
        if kill:
            worker.client.kill()
        if here:
            self.registry.left(worker.worker_id)
        log.warning("worker %s left", worker.worker_id)
        self.changed()
        return unpaired

    def in_background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def changed(self) -> None:
        self._tell_wanted()
        for listener in self.on_change:
            listener()

    def _tell_wanted(self) -> None:
        if self.spawner is None:
            return
        wanted: dict[str, int] = {}
        # one joining counts once: a member already while its join completes
        for role in [w.state.role for w in self.workers.values()] + [
                j.role for worker_id, j in self.joining.items()
                if j.state != "failed" and worker_id not in self.workers]:
            wanted[role] = wanted.get(role, 0) + 1
        self.spawner.wanted(wanted)
