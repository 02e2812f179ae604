"""Workers leaving and rejoining service, for one Pool.

A worker whose process died is out of service at once and back once its restart
answers (re-paired, re-subscribed: what was learned of its old process goes); one
silent past the stall bound is out of service until it reports again; one not back
within revive_timeout_s is evicted and, when the pool can spawn workers (and this
replica is the one that replaces), replaced by a fresh one."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pdserve.router.errors import short_reason
from pdserve.router.pool.workers import WorkerHandle

if TYPE_CHECKING:
    from pdserve.router.pool.pool import Pool

log = logging.getLogger(__name__)


class Supervision:
    def __init__(self, pool: Pool):
        self.pool = pool
        self.reviving: dict[str, asyncio.Task] = {}  # worker id -> its revival

    def died(self, worker: WorkerHandle) -> None:
        """Its process died: out of service now, back once it has been restarted, or
        evicted (and replaced) if it is not back within revive_timeout_s."""
        if worker.worker_id in self.reviving or worker.worker_id not in self.pool.workers:
            return
        worker.update(alive=False)
        log.error("worker %s died; waiting for its restart", worker.worker_id)
        self.reviving[worker.worker_id] = asyncio.get_running_loop().create_task(
            self._revive(worker))
        self.pool.changed()

    def stalled(self, worker: WorkerHandle) -> None:
        """Silent (out of placement), or silent past the stall bound (its requests
        failed already), until it reports again (this is called again then); evicted
        (and replaced) if it stays stalled for revive_timeout_s more."""
        self.pool.changed()
        if worker.state.alive:
            return
        revive_timeout_s = self.pool.config.revive_timeout_s

        async def evict_if_silent() -> None:
            await asyncio.sleep(revive_timeout_s)  # a bound, not a sync
            if not worker.state.alive and self.pool.workers.get(worker.worker_id) is worker \
                    and worker.worker_id not in self.reviving:
                log.error("worker %s stayed silent for %gs more; evicting it",
                          worker.worker_id, revive_timeout_s)
                self._evict(worker)
        self.pool.in_background(evict_if_silent())

    def forget(self, worker_id: str) -> None:
        """The worker left: its revival, if one is under way, ends."""
        revival = self.reviving.pop(worker_id, None)
        if revival is not None:
            revival.cancel()

    def stop(self) -> None:
        for task in self.reviving.values():
            task.cancel()

    async def _revive(self, worker: WorkerHandle) -> None:
        """Waits for the restarted process to answer (its model loads first), pairs it
        with the live workers of the other side, and puts it back in service. Gives
        up after revive_timeout_s (its restarts spent, or it cannot be placed): the
        worker is evicted and, if the pool can spawn, replaced by a fresh one."""
        loop = asyncio.get_running_loop()
        revive_timeout_s = self.pool.config.revive_timeout_s
        deadline = loop.time() + revive_timeout_s
        backoff = 0.05
        while True:
            try:
                await self.rejoin(worker)
                break
            except asyncio.CancelledError:
                self.reviving.pop(worker.worker_id, None)
                raise
            except Exception as exc:
                if loop.time() + backoff > deadline:
                    log.error("worker %s did not come back within %gs: %s; evicting it",
                              worker.worker_id, revive_timeout_s, short_reason(exc))
                    self.reviving.pop(worker.worker_id, None)
                    self._evict(worker)
                    return
                await asyncio.sleep(backoff)  # polling: a restart sends no event
                backoff = min(2 * backoff, 2.0)
        self.reviving.pop(worker.worker_id, None)
        log.warning("worker %s is back in service", worker.worker_id)
        self.pool.changed()

    async def rejoin(self, worker: WorkerHandle) -> None:
        """A restarted worker back in service, once its new process answers."""
        pool = self.pool
        stats = await asyncio.wait_for(worker.client.stats(), pool.config.control_timeout_s)
        # A new process, maybe on another node, listening on a new rendezvous: what
        # was learned of the old one (steps, transfers, calibration, prefixes) goes,
        # and so do the pairs with its old rendezvous.
        await pool.pairing.leave(worker, worker.address)
        worker.address, worker.generation = "", stats.incarnation
        worker.update(num_blocks=stats.num_blocks)
        pool.on_restart(worker)
        await pool.pairing.join(worker)
        worker.serving_since = pool.now()
        pool.subscribe(worker)
        pool.registry.changed(pool.entry(worker))

    def _evict(self, worker: WorkerHandle) -> None:
        self.pool.leave(worker, kill=True)
        if self.pool.spawner is not None and self.pool.may_replace():
            self.pool.in_background(self._replace(worker.state.role))

    async def _replace(self, role: str) -> None:
        try:
            worker_id = await self.pool.add(role)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("no replacement %s worker could be started: %s", role,
                      short_reason(exc))
            return
        log.warning("worker %s replaces an evicted %s worker", worker_id, role)
