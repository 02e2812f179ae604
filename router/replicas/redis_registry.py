"""The pool registry in Redis (`--redis-url`; docs/replicas.md): the pool's record and
its workers, which every router replica over the pool keeps and follows.

Keys, under the cluster's prefix P (each with a TTL every live replica renews every
third of it, so none outlives the last replica by more than the TTL):
- `P:pool`: the pool's record (PoolRecord, JSON): where its Ray cluster is, the model,
  how to start its workers. Set by the replica that launched the pool.
- `P:workers`: a hash, worker id -> its entry (WorkerEntry, JSON), written by the
  replica that changed the worker.
- `P:routers`: a sorted set of the live replicas, each scored by when its heartbeat
  expires (ms): the last one to stop ends the pool; the replica that removes an
  expired one tells its pool, which ends that replica's requests on every worker.
- `P:worker-seq`: the last number given to a worker added at run time (ids stay
  unique whichever replica adds one).
- `P:membership` (channel): each change, "<replica id>\\n<worker id>\\n<entry JSON, or
  empty when it left>".

A replica applies every change it hears, and reads the whole hash again whenever it
(re)subscribes and on every renewal, so one lost message costs at most a renewal
period. A worker leaves a replica's pool only on a change that says so (or its own
death): an entry missing from the hash (Redis restarted empty) does not remove it.

Redis unreachable: changes are kept (the last per worker) and sent once it answers
again; every replica goes on with its own pool. Redis back empty: the next renewal of
each replica writes its own workers' entries again (those absent only: what another
replica wrote since wins) and the record, so the registry is rebuilt from the
replicas' views of the workers."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.router.replicas.pool_registry import (
    Applied,
    Gone,
    PoolRecord,
    RegistryError,
    WorkerEntry,
)
from pdserve.router.replicas.redis_client import Reachability, blocking, listen, stopping

if TYPE_CHECKING:
    from pdserve.router.config import SharedStateSpec

log = logging.getLogger(__name__)


def keys(prefix: str) -> dict[str, str]:
    return {"pool": f"{prefix}:pool", "workers": f"{prefix}:workers",
            "routers": f"{prefix}:routers", "seq": f"{prefix}:worker-seq",
            "channel": f"{prefix}:membership"}


def read_registered(spec: SharedStateSpec) -> tuple[PoolRecord | None, list[WorkerEntry]]:
    """The pool registered under spec's prefix (None if none) and its workers, read
    outside any event loop; RedisError when Redis cannot be reached."""
    client, named = blocking(spec), keys(spec.redis_prefix)
    try:
        record, entries = client.get(named["pool"]), client.hgetall(named["workers"])
    finally:
        client.close()
    return (None if record is None else PoolRecord.from_json(record),
            [WorkerEntry.from_json(text) for text in entries.values()])


def _now_ms() -> int:
    return int(time.time() * 1e3)


class RedisRegistry:
    shared = True

    def __init__(self, client: Redis, prefix: str, replica_id: str, ttl_s: float,
                 backoff_s: tuple[float, float] = (0.05, 5.0)):
        self.client, self.prefix, self.replica_id = client, prefix, replica_id
        self.ttl_s, self.backoff_s = ttl_s, backoff_s
        named = keys(prefix)
        self.pool_key, self.workers_key = named["pool"], named["workers"]
        self.routers_key, self.seq_key = named["routers"], named["seq"]
        self.channel = named["channel"]
        self.record: PoolRecord | None = None
        self._mine: dict[str, WorkerEntry] = {}  # this replica's view, re-written if lost
        self._outbox: dict[str, WorkerEntry | None] = {}  # changes not yet sent
        self._sender: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._apply: Applied = lambda worker_id, entry: None
        self._gone: Gone = lambda replica_id: None
        self.listening = asyncio.Event()  # set while subscribed to membership changes
        self.redis = Reachability("the pool")
        self._unreachable, self._reached = self.redis.lost, self.redis.reached

    # ---- the pool as a whole --------------------------------------------------------

    async def read_record(self) -> PoolRecord:
        """The registered pool's record; RegistryError when none is registered."""
        text = await self.client.get(self.pool_key)
        if text is None:
            raise RegistryError(f"no pool is registered under {self.prefix!r} (start one "
                                "with `pdserve serve --redis-url`, or name its --redis-prefix)")
        return PoolRecord.from_json(text)

    async def start(self, record: PoolRecord | None, entries: list[WorkerEntry],
                    apply: Applied, gone: Gone = lambda replica_id: None) -> None:
        self._apply, self._gone = apply, gone
        if record is not None:
            if not await self.client.set(self.pool_key, record.to_json(), nx=True,
                                         px=self._ttl_ms()):
                raise RegistryError(f"another pool is registered under {self.prefix!r}: "
                                    "join it with `pdserve router`, or choose another "
                                    "--redis-prefix")
            self.record = record
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self.workers_key)
                if entries:
                    pipe.hset(self.workers_key, mapping={e.worker_id: e.to_json()
                                                         for e in entries})
                pipe.pexpire(self.workers_key, self._ttl_ms())
                pipe.set(self.seq_key, len(entries), px=self._ttl_ms())
                await pipe.execute()
        else:
            self.record = await self.read_record()
        self._mine = {e.worker_id: e for e in entries}
        await self._heartbeat()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen()), loop.create_task(self._renewing())]

    async def stop(self) -> bool:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)
        last = True
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zrem(self.routers_key, self.replica_id)
                pipe.zcount(self.routers_key, _now_ms(), "+inf")
                _, others = await pipe.execute()
            last = others == 0
            if last:
                await self.client.delete(self.pool_key, self.workers_key, self.routers_key,
                                         self.seq_key)
        except RedisError as err:  # the others' TTLs end this replica's part
            log.warning("pool registry: could not sign off (%s)", err)
            last = False  # another replica may still serve: its workers stay
        await self.client.aclose()
        return last

    async def entries(self) -> dict[str, WorkerEntry]:
        return {worker_id: WorkerEntry.from_json(text)
                for worker_id, text in (await self.client.hgetall(self.workers_key)).items()}

    async def next_worker_number(self) -> int | None:
        try:
            return int(await self.client.incr(self.seq_key))
        except RedisError as err:
            self._unreachable("number a worker", err)
            return None

    # ---- changes ---------------------------------------------------------------------

    def changed(self, entry: WorkerEntry) -> None:
        self._mine[entry.worker_id] = entry
        self._send(entry.worker_id, entry)

    def left(self, worker_id: str) -> None:
        self._mine.pop(worker_id, None)
        self._send(worker_id, None)

    def follow(self, entry: WorkerEntry | None, worker_id: str) -> None:
        """Another replica's change, applied here: this replica's view follows it
        (what it writes again after a Redis restart)."""
        if entry is None:
            self._mine.pop(worker_id, None)
        else:
            self._mine[worker_id] = entry

    def _send(self, worker_id: str, entry: WorkerEntry | None) -> None:
        self._outbox.pop(worker_id, None)  # the latest change last: order kept
        self._outbox[worker_id] = entry
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all())

    async def sent(self) -> None:
        """Returns once every change so far was sent, or kept for when Redis answers."""
        while self._sender is not None and not self._sender.done():
            await asyncio.gather(self._sender, return_exceptions=True)

    async def _send_all(self) -> None:
        while self._outbox:
            worker_id, entry = next(iter(self._outbox.items()))
            try:
                async with self.client.pipeline(transaction=True) as pipe:
                    if entry is None:
                        pipe.hdel(self.workers_key, worker_id)
                    else:
                        pipe.hset(self.workers_key, worker_id, entry.to_json())
                        _extend(pipe, self.workers_key, self._ttl_ms())
                    text = "" if entry is None else entry.to_json()
                    pipe.publish(self.channel, f"{self.replica_id}\n{worker_id}\n{text}")
                    await pipe.execute()
            except RedisError as err:
                self._unreachable("record a membership change", err)
                return  # kept: the next renewal that reaches Redis sends it
            self._reached()
            if self._outbox.get(worker_id, 0) is entry:
                del self._outbox[worker_id]

    # ---- what the other replicas change ---------------------------------------------

    def _heard(self, data: str) -> None:
        replica_id, worker_id, text = data.split("\n", 2)
        if replica_id == self.replica_id:
            return  # its own change, applied here already
        entry = WorkerEntry.from_json(text) if text else None
        self.follow(entry, worker_id)
        self._apply(worker_id, entry)

    async def _resync(self) -> None:
        """Applies every entry in the hash (what a lost message would have said)."""
        for worker_id, entry in (await self.entries()).items():
            if worker_id not in self._outbox and self._mine.get(worker_id) != entry:
                self.follow(entry, worker_id)
                self._apply(worker_id, entry)

    async def _listen(self) -> None:
        def up() -> None:
            self.listening.set()
            self._reached()
            asyncio.get_running_loop().create_task(self._resync_quietly())

        def down(err: Exception) -> None:
            self.listening.clear()
            self._unreachable("listen", err)
        await listen(self.client, self.channel, self._heard, up, down, self.backoff_s,
                     "pool registry")

    async def _resync_quietly(self) -> None:
        try:
            await self._resync()
        except RedisError as err:
            self._unreachable("read the registry", err)

    async def _heartbeat(self) -> None:
        """This replica is alive; every key renewed; what Redis lost written again."""
        ttl_ms, now = self._ttl_ms(), _now_ms()
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self.routers_key, {self.replica_id: now + ttl_ms})
            pipe.zrangebyscore(self.routers_key, "-inf", now)
            for key in (self.routers_key, self.workers_key, self.seq_key, self.pool_key):
                _extend(pipe, key, ttl_ms)
            pipe.exists(self.pool_key)
            done = await pipe.execute()
        expired, renewed = done[1], done[-1]
        for replica_id in expired:  # died: the one replica whose ZREM takes it says so
            if await self.client.zrem(self.routers_key, replica_id):
                log.warning("router replica %s stopped renewing: it is gone", replica_id)
                self._gone(replica_id)
        if not renewed and self.record is not None:  # Redis lost the pool (restarted empty)
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.set(self.pool_key, self.record.to_json(), px=ttl_ms, nx=True)
                for entry in self._mine.values():
                    pipe.hsetnx(self.workers_key, entry.worker_id, entry.to_json())
                _extend(pipe, self.workers_key, ttl_ms)
                await pipe.execute()
            log.warning("pool registry: written again from this replica's view (%d workers)",
                        len(self._mine))

    async def _renewing(self) -> None:
        while not stopping():
            await asyncio.sleep(self.ttl_s / 3 if self.redis.reachable
                                else min(self.ttl_s / 3, self.backoff_s[1]))
            try:
                await self._heartbeat()
                self._reached()
                if self._outbox and (self._sender is None or self._sender.done()):
                    self._sender = asyncio.get_running_loop().create_task(self._send_all())
                await self._resync()
            except RedisError as err:
                self._unreachable("renew", err)
            except Exception:  # a bug here must not end the renewals
                log.exception("pool registry: a renewal failed")

    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1e3))


def _extend(pipe, key: str, ttl_ms: int) -> None:
    """The shared key's TTL to at least ttl_ms, never shorter: replicas may run with
    different TTLs, and one with a short TTL that dies must not take the pool's keys
    (the routers' set among them, with its own entry) down before the others renew
    them. NX for a key that has none (one an HSET or INCR made again), GT otherwise:
    Redis (7.0+) takes one of the two per call."""
    pipe.pexpire(key, ttl_ms, nx=True)
    pipe.pexpire(key, ttl_ms, gt=True)
