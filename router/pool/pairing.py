"""Which workers hold a KV pair with which. A worker that may send KV (role prefill,
or both in adaptive mode) is paired with every decode-capable worker ahead of
traffic, off the engine threads; every pair with a decode rendezvous that left (its
worker removed, evicted, restarted or no longer decoding) is closed, so no
connection, process group or thread stays behind for it on any worker. Best effort
both ways: a pair not opened now opens on its first request; one not closed now
fails, and is dropped, on its next use."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pdserve.router.config import RouterConfig
from pdserve.router.errors import WorkerDied, short_reason
from pdserve.router.pool.workers import WorkerHandle

log = logging.getLogger(__name__)


class Pairing:
    def __init__(self, workers: dict[str, WorkerHandle], config: RouterConfig,
                 on_dead: Callable[[WorkerHandle], None]):
        """workers: the pool's members (read, never changed here); on_dead(worker): a
        worker found dead on the way."""
        self.workers, self.config, self.on_dead = workers, config, on_dead

    async def join(self, worker: WorkerHandle) -> None:
        """Pairs the worker with every live worker it may send KV to or receive KV
        from. Outside adaptive mode, workers in role both run whole requests only and
        send nothing."""
        timeout_s, adaptive = self.config.control_timeout_s, self.config.adaptive
        if worker.state.decodes and not worker.address:
            worker.address = await asyncio.wait_for(worker.client.address(), timeout_s)
        live = [w for w in self.workers.values() if w.state.alive and w is not worker]
        pairs = []
        if worker.state.sends_kv(adaptive):
            pairs += [(worker, d.address) for d in live if d.state.decodes and d.address]
        if worker.state.decodes:
            pairs += [(p, worker.address) for p in live if p.state.sends_kv(adaptive)]
        results = await asyncio.gather(*[
            asyncio.wait_for(p.client.connect([address]), timeout_s)
            for p, address in pairs], return_exceptions=True)
        for (prefill, address), result in zip(pairs, results):
            if isinstance(result, Exception):
                log.warning("pairing %s with %s failed: %s", prefill.worker_id, address,
                            short_reason(result))
                if isinstance(result, WorkerDied):
                    self.on_dead(prefill)

    async def leave(self, worker: WorkerHandle, address: str) -> None:
        """Every other live worker that may send KV closes its pair with `address`,
        the worker's decode rendezvous, which left."""
        others = [w for w in self.workers.values()
                  if w is not worker and w.state.alive and w.state.role != "decode"]
        if not address or not others:
            return
        timeout_s = self.config.control_timeout_s
        results = await asyncio.gather(*[
            asyncio.wait_for(w.client.disconnect([address]), timeout_s) for w in others],
            return_exceptions=True)
        for other, result in zip(others, results):
            if isinstance(result, Exception):
                log.warning("%s could not close its pair with %s: %s", other.worker_id,
                            address, short_reason(result))
