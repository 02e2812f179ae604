"""The workers this router serves with, and their supervision.

Membership is live: a worker joins paired and subscribed, drains, changes role (its
weights stay loaded) and leaves once this router's requests on it are done. A
worker whose process died is out of service at once and back once its restart
answers; one silent past the stall bound is out of service until it reports again;
one not back within revive_timeout_s is evicted and, when the pool can spawn
workers, replaced. Workers are paired as they join, change role or come back, and
their pairs closed as they leave (pairing.py). Every call to a worker goes through
its WorkerClient.

With other router replicas over the same workers (pool_registry.py), every change this
pool makes is recorded in the registry and every change another replica makes is
applied here: the replica that makes a change does what the workers must do for it
(spawning, pairing, the role change, the kill); the others follow. A drain waits for
every replica's requests on the worker (its own reports say when it holds none), and
of the replicas that see a worker evicted only one replaces it (`may_replace`)."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from pdserve.engine.worker_messages import check_role
from pdserve.router.config import RouterConfig
from pdserve.router.errors import short_reason
from pdserve.router.pairing import Pairing
from pdserve.router.pool_registry import LocalRegistry, PoolRegistry, WorkerEntry
from pdserve.router.worker_client import WorkerClient
from pdserve.router.workers import WorkerHandle

log = logging.getLogger(__name__)

# progress(worker_id, state): a worker being started is "pending" (not yet placed)
# or "starting" (placed, loading).
Progress = Callable[[str, str], None]


class Spawner(Protocol):
    """Starts workers: launch.WorkerSpawner on Ray, SimCluster in the simulator."""

    async def __call__(self, role: str, progress: Progress) -> WorkerHandle:
        """A fresh worker of `role`, loaded and ready, not yet paired or subscribed,
        telling its progress."""

    def wanted(self, workers: dict[str, int]) -> None:
        """The pool's workers by role, those being added included, whenever that
        changes: a cluster that adds nodes on demand keeps room for them."""

    async def attach(self, locator: str) -> WorkerClient:
        """A client of a worker another router replica started (WorkerEntry.locator)."""


Hook = Callable[[WorkerHandle], None]
# Workers that failed to start, kept to be shown (admin list) with their reason.
KEPT_FAILURES = 16


@dataclass
class Joining:
    """A worker being added, not yet a member: "pending" (Ray has not placed it),
    "starting" (loading, then pairing) or "failed" (abandoned; `error` says why)."""
    worker_id: str
    role: str
    state: str
    since: float  # monotonic, when it was asked for
    error: str = ""


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
        self._reviving: dict[str, asyncio.Task] = {}  # worker id -> its revival
        # Eviction timers of silent workers and fresh workers for evicted ones.
        self._background: set[asyncio.Task] = set()
        self._started = False
        self.pairing = Pairing(self.workers, config, on_dead=self.died)
        self.closing = asyncio.Event()  # set by close(): the router is shutting down
        self.registry = registry or LocalRegistry()
        self.may_replace = may_replace
        self._idle: dict[str, tuple[float, asyncio.Event]] = {}  # drains awaiting reports
        # Workers another replica added, being reached: the latest entry heard for each.
        self._attaching: dict[str, WorkerEntry] = {}
        self.orphans_ended = 0  # requests of replicas gone, ended on the workers here
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
            if w.worker_id in self._reviving:
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
            self._subscribe(worker)
        await self.registry.start(record, [self.entry(w) for w in self.workers.values()],
                                  self.apply, self.replica_gone)
        if self.registry.shared:
            self._in_background(self._keeping_alive())

    def close(self) -> None:
        """The router is shutting down: membership operations under way end now (the
        admin API answers them 503) and none starts."""
        self.closing.set()

    async def stop(self) -> bool:
        """Stops supervising and following; True when no other replica serves these
        workers any more (whoever stops the last router ends them)."""
        self.close()
        for task in [*self._reviving.values(), *self._background]:
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
                                                  state=state, since=self._now())
                self._spawns[worker_id] = spawn
                spawn.add_done_callback(lambda _: self._spawns.pop(worker_id, None))
                self._tell_wanted()
            else:
                entry.state = state
            if not named.done():
                named.set_result(worker_id)
        spawn = self._in_background(self._spawn(role, progress))
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
            self.startup_times.append(self._now() - entry.since)
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
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def join(self, worker: WorkerHandle) -> None:
        """Puts a loaded worker into service: paired with every worker of the other
        side (off the engine threads, before any traffic), subscribed, then chosen."""
        if worker.worker_id in self.workers:
            raise MembershipError(f"worker {worker.worker_id} is already a member")
        worker.update(draining=True)  # no traffic until paired and subscribed
        self.admit(worker)
        await self.pairing.join(worker)
        if self._started:
            self._subscribe(worker)
        worker.update(draining=False)
        worker.serving_since = self._now()
        log.warning("worker %s (%s) joined", worker.worker_id, worker.state.role)
        self.registry.changed(self.entry(worker))
        self._changed()

    async def drain(self, worker_id: str, timeout_s: float | None = None) -> None:
        """Stops new work on the worker and waits until this router's requests on it
        are done. It stays a member, draining, until resumed, re-roled or removed.
        Raises MembershipError (504) if they are not done within timeout_s; it stays
        draining then."""
        worker = self.member(worker_id)
        drained = worker.drain()
        since = self._now()
        self.registry.changed(self.entry(worker))
        self._changed()
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
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
        self._changed()

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
        worker.serving_since = self._now()
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
        unpaired = self._leave(worker, kill)
        if unpaired is not None:
            await unpaired  # it has left already; its pairs are closed by the time this returns

    def member(self, worker_id: str) -> WorkerHandle:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise MembershipError(f"no worker {worker_id!r}", 404)
        return worker

    def _subscribe(self, worker: WorkerHandle) -> None:
        worker.start_pump(self.config.stall_timeout_s, self.subscriber, self._reported,
                          self.died, self._stalled, self.config.telemetry_stale_s)

    def _reported(self, worker: WorkerHandle, telemetry) -> None:
        self.on_report(worker, telemetry)  # looked up per report: a hook may be replaced
        self.reported(worker)

    # ---- changes another replica made -------------------------------------------------

    def apply(self, worker_id: str, entry: WorkerEntry | None) -> None:
        """Another replica changed the worker (entry None: it left through it): the
        change is applied here, without doing again what that replica did to the
        workers (spawn, pair, change role, kill)."""
        worker = self.workers.get(worker_id)
        if entry is None:
            self._attaching.pop(worker_id, None)
            if worker is not None:
                self._leave(worker, kill=False, here=False)
            return
        if worker is None:
            if self.spawner is None:
                log.error("worker %s joined through another router, but this one cannot "
                          "reach workers it did not start", worker_id)
            elif worker_id in self._attaching:
                self._attaching[worker_id] = entry  # it joins as this says
            elif worker_id not in self._spawns and not self.closing.is_set():
                self._attaching[worker_id] = entry
                self._in_background(self._attach(entry))
            return
        if entry.generation and entry.generation != worker.generation \
                and worker.worker_id not in self._reviving:
            # restarted: what was learned of its earlier process goes (as _rejoin does)
            worker.generation, worker.address = entry.generation, entry.address
            worker.update(num_blocks=entry.num_blocks)
            self.on_restart(worker)
            if self._started:
                self._subscribe(worker)
        if entry.role != worker.state.role:
            worker.update(role=entry.role)
            worker.serving_since = self._now()
        worker.address = entry.address or worker.address
        if entry.draining != worker.state.draining:
            worker.update(draining=entry.draining)
        self._changed()

    async def _keeping_alive(self) -> None:
        """A shared pool's workers end themselves when no router has asked them for
        their stats for a while (their every replica gone): each replica asks every
        third of the registry's TTL."""
        while True:
            await asyncio.sleep(self.config.shared.registry_ttl_s / 3)  # the period
            await asyncio.gather(*[
                asyncio.wait_for(w.client.stats(), self.config.control_timeout_s)
                for w in list(self.workers.values()) if w.state.alive],
                return_exceptions=True)  # a worker that does not answer: its pump says

    def replica_gone(self, replica_id: str) -> None:
        """Another replica died: its requests on every worker end and free their KV (a
        worker cannot tell that a subscriber stopped reading its stream)."""
        async def end_its_requests() -> None:
            workers = list(self.workers.values())
            ended = await asyncio.gather(*[
                asyncio.wait_for(w.client.abort_all(replica_id), self.config.control_timeout_s)
                for w in workers], return_exceptions=True)
            counts = {w.worker_id: n for w, n in zip(workers, ended)
                      if not isinstance(n, BaseException)}
            self.orphans_ended += sum(counts.values())
            log.warning("router replica %s is gone: %d of its requests ended on %d "
                        "worker(s)", replica_id, sum(counts.values()), len(counts))
        self._in_background(end_its_requests())

    async def _attach(self, entry: WorkerEntry) -> None:
        """A worker another replica added: reached through its locator, subscribed,
        in service here as it is there."""
        try:
            client = await asyncio.wait_for(self.spawner.attach(entry.locator),
                                            self.config.control_timeout_s)
        except asyncio.CancelledError:
            self._attaching.pop(entry.worker_id, None)
            raise
        except Exception as exc:
            self._attaching.pop(entry.worker_id, None)
            log.error("worker %s, added by another router, cannot be reached: %s",
                      entry.worker_id, short_reason(exc))
            return
        entry = self._attaching.pop(entry.worker_id, None)
        if entry is None or entry.worker_id in self.workers:
            return  # it left meanwhile
        worker = WorkerHandle.of(entry.worker_id, client, entry.role,
                                 num_blocks=entry.num_blocks, address=entry.address,
                                 locator=entry.locator, generation=entry.generation)
        worker.update(draining=entry.draining)
        worker.serving_since = self._now()
        self.admit(worker)
        if self._started:
            self._subscribe(worker)
        log.warning("worker %s (%s) joined through another router", entry.worker_id,
                    entry.role)
        self._changed()

    def _leave(self, worker: WorkerHandle, kill: bool, here: bool = True
               ) -> asyncio.Task | None:
        """Returns the closing of the pairs with it, which goes on in the background.
        here False: it left through another replica, which closed its pairs."""
        worker.stop_pump()
        revival = self._reviving.pop(worker.worker_id, None)
        if revival is not None:
            revival.cancel()
        self.workers.pop(worker.worker_id, None)
        unpaired = (self._in_background(self.pairing.leave(worker, worker.address))
                    if worker.address and here else None)
        self.on_leave(worker)
        if kill:
            worker.client.kill()
        if here:
            self.registry.left(worker.worker_id)
        log.warning("worker %s left", worker.worker_id)
        self._changed()
        return unpaired

    # ---- workers leaving and rejoining service ---------------------------------------

    def died(self, worker: WorkerHandle) -> None:
        """Its process died: out of service now, back once it has been restarted, or
        evicted (and replaced) if it is not back within revive_timeout_s."""
        if worker.worker_id in self._reviving or worker.worker_id not in self.workers:
            return
        worker.update(alive=False)
        log.error("worker %s died; waiting for its restart", worker.worker_id)
        self._reviving[worker.worker_id] = asyncio.get_running_loop().create_task(
            self._revive(worker))
        self._changed()

    def _stalled(self, worker: WorkerHandle) -> None:
        """Silent (out of placement), or silent past the stall bound (its requests
        failed already), until it reports again (this is called again then); evicted
        (and replaced) if it stays stalled for revive_timeout_s more."""
        self._changed()
        if worker.state.alive:
            return

        async def evict_if_silent() -> None:
            await asyncio.sleep(self.config.revive_timeout_s)  # a bound, not a sync
            if not worker.state.alive and self.workers.get(worker.worker_id) is worker \
                    and worker.worker_id not in self._reviving:
                log.error("worker %s stayed silent for %gs more; evicting it",
                          worker.worker_id, self.config.revive_timeout_s)
                self._evict(worker)
        self._in_background(evict_if_silent())

    async def _revive(self, worker: WorkerHandle) -> None:
        """Waits for the restarted process to answer (its model loads first), pairs it
        with the live workers of the other side, and puts it back in service. Gives
        up after revive_timeout_s (its restarts spent, or it cannot be placed): the
        worker is evicted and, if the pool can spawn, replaced by a fresh one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.revive_timeout_s
        backoff = 0.05
        while True:
            try:
                await self._rejoin(worker)
                break
            except asyncio.CancelledError:
                self._reviving.pop(worker.worker_id, None)
                raise
            except Exception as exc:
                if loop.time() + backoff > deadline:
                    log.error("worker %s did not come back within %gs: %s; evicting it",
                              worker.worker_id, self.config.revive_timeout_s,
                              short_reason(exc))
                    self._reviving.pop(worker.worker_id, None)
                    self._evict(worker)
                    return
                await asyncio.sleep(backoff)  # polling: a restart sends no event
                backoff = min(2 * backoff, 2.0)
        self._reviving.pop(worker.worker_id, None)
        log.warning("worker %s is back in service", worker.worker_id)
        self._changed()

    def _evict(self, worker: WorkerHandle) -> None:
        self._leave(worker, kill=True)
        if self.spawner is not None and self.may_replace():
            self._in_background(self._replace(worker.state.role))

    async def _replace(self, role: str) -> None:
        try:
            worker_id = await self.add(role)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("no replacement %s worker could be started: %s", role,
                      short_reason(exc))
            return
        log.warning("worker %s replaces an evicted %s worker", worker_id, role)

    async def _rejoin(self, worker: WorkerHandle) -> None:
        stats = await asyncio.wait_for(worker.client.stats(), self.config.control_timeout_s)
        # A new process, maybe on another node, listening on a new rendezvous: what
        # was learned of the old one (steps, transfers, calibration, prefixes) goes,
        # and so do the pairs with its old rendezvous.
        await self.pairing.leave(worker, worker.address)
        worker.address, worker.generation = "", stats.incarnation
        worker.update(num_blocks=stats.num_blocks)
        self.on_restart(worker)
        await self.pairing.join(worker)
        worker.serving_since = self._now()
        self._subscribe(worker)
        self.registry.changed(self.entry(worker))

    def _in_background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _changed(self) -> None:
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
