"""Changes another router replica made to the pool, followed here.

With other replicas over the same workers (pool_registry.py), every change this pool
makes is recorded in the registry, and every change another replica makes is applied
here through this: the replica that makes a change does what the workers must do for
it (spawning, pairing, the role change, the kill); the others follow. A worker another
replica added is reached through its locator; a replica that died has its requests
ended on every worker; and the workers are kept alive while any replica serves."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pdserve.router.errors import short_reason
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.pool_registry import WorkerEntry

if TYPE_CHECKING:
    from pdserve.router.pool.pool import Pool

log = logging.getLogger(__name__)


class ReplicaFollower:
    def __init__(self, pool: Pool):
        self.pool = pool
        # Workers another replica added, being reached: the latest entry heard for each.
        self.attaching: dict[str, WorkerEntry] = {}
        self.orphans_ended = 0  # requests of replicas gone, ended on the workers here

    def apply(self, worker_id: str, entry: WorkerEntry | None) -> None:
        """Another replica changed the worker (entry None: it left through it): the
        change is applied here, without doing again what that replica did to the
        workers (spawn, pair, change role, kill)."""
        pool = self.pool
        worker = pool.workers.get(worker_id)
        if entry is None:
            self.attaching.pop(worker_id, None)
            if worker is not None:
                pool.leave(worker, kill=False, here=False)
            return
        if worker is None:
            if pool.spawner is None:
                log.error("worker %s joined through another router, but this one cannot "
                          "reach workers it did not start", worker_id)
            elif worker_id in self.attaching:
                self.attaching[worker_id] = entry  # it joins as this says
            elif not pool.spawning(worker_id) and not pool.closing.is_set():
                self.attaching[worker_id] = entry
                pool.in_background(self._attach(entry))
            return
        if entry.generation and entry.generation != worker.generation \
                and worker.worker_id not in pool.supervision.reviving:
            # restarted: what was learned of its earlier process goes (as rejoin does)
            worker.generation, worker.address = entry.generation, entry.address
            worker.update(num_blocks=entry.num_blocks)
            pool.on_restart(worker)
            pool.subscribe(worker)
        if entry.role != worker.state.role:
            worker.update(role=entry.role)
            worker.serving_since = pool.now()
        worker.address = entry.address or worker.address
        if entry.draining != worker.state.draining:
            worker.update(draining=entry.draining)
        pool.changed()

    async def keep_alive(self) -> None:
        """A shared pool's workers end themselves when no router has asked them for
        their stats for a while (their every replica gone): each replica asks every
        third of the registry's TTL."""
        config = self.pool.config
        while True:
            await asyncio.sleep(config.shared.registry_ttl_s / 3)  # the period
            await asyncio.gather(*[
                asyncio.wait_for(w.client.stats(), config.control_timeout_s)
                for w in list(self.pool.workers.values()) if w.state.alive],
                return_exceptions=True)  # a worker that does not answer: its pump says

    def replica_gone(self, replica_id: str) -> None:
        """Another replica died: its requests on every worker end and free their KV (a
        worker cannot tell that a subscriber stopped reading its stream)."""
        async def end_its_requests() -> None:
            workers = list(self.pool.workers.values())
            ended = await asyncio.gather(*[
                asyncio.wait_for(w.client.abort_all(replica_id),
                                 self.pool.config.control_timeout_s)
                for w in workers], return_exceptions=True)
            counts = {w.worker_id: n for w, n in zip(workers, ended)
                      if not isinstance(n, BaseException)}
            self.orphans_ended += sum(counts.values())
            log.warning("router replica %s is gone: %d of its requests ended on %d "
                        "worker(s)", replica_id, sum(counts.values()), len(counts))
        self.pool.in_background(end_its_requests())

    async def _attach(self, entry: WorkerEntry) -> None:
        """A worker another replica added: reached through its locator, subscribed,
        in service here as it is there."""
        pool = self.pool
        try:
            client = await asyncio.wait_for(pool.spawner.attach(entry.locator),
                                            pool.config.control_timeout_s)
        except asyncio.CancelledError:
            self.attaching.pop(entry.worker_id, None)
            raise
        except Exception as exc:
            self.attaching.pop(entry.worker_id, None)
            log.error("worker %s, added by another router, cannot be reached: %s",
                      entry.worker_id, short_reason(exc))
            return
        entry = self.attaching.pop(entry.worker_id, None)
        if entry is None or entry.worker_id in pool.workers:
            return  # it left meanwhile
        worker = WorkerHandle.of(entry.worker_id, client, entry.role,
                                 num_blocks=entry.num_blocks, address=entry.address,
                                 locator=entry.locator, generation=entry.generation)
        worker.update(draining=entry.draining)
        worker.serving_since = pool.now()
        pool.admit(worker)
        pool.subscribe(worker)
        log.warning("worker %s (%s) joined through another router", entry.worker_id,
                    entry.role)
        pool.changed()
