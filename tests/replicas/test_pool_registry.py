"""The pool registry several router replicas share in Redis (a real redis-server): a
pool registered once, each replica's membership changes applied by the others in
order (and read again after a lost message), every key bounded by its TTL, the
registry rebuilt from the replicas after Redis restarts empty, and the pool ended by
its last replica."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import pytest
from redis.exceptions import RedisError

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec, SharedStateSpec
from pdserve.router.model_info import ModelInfo
from pdserve.router.replicas.pool_registry import PoolRecord, RegistryError, WorkerEntry
from pdserve.router.replicas.redis_client import connect
from pdserve.router.replicas.redis_registry import RedisRegistry, read_registered
from tests.polling import eventually

TTL_S = 3.0
RECORD = PoolRecord.of(
    pool_id="p1", ray_address="127.0.0.1:6379", namespace="pdserve",
    model=ModelInfo(name="m", max_model_len=512, vocab_size=2048, block_size=16),
    adaptive=False, engine=EngineConfig.from_kwargs("/models/m", block_size=16, max_num_seqs=8),
    pools=PoolSpec(1, 2), transfer=TransferConfig(timeout_s=7, secret="s3cret"))
DECODE = WorkerEntry(worker_id="decode-1", role="decode", draining=False, locator="a-d1",
                     address="10.0.0.1:5000", num_blocks=64, generation="g1")
PREFILL = WorkerEntry(worker_id="prefill-0", role="prefill", draining=False,
                      locator="a-p0", address="", num_blocks=64, generation="g0")


def spec_of(server) -> SharedStateSpec:
    return SharedStateSpec(redis_url=server.url, redis_prefix="t", registry_ttl_s=TTL_S)


def registry(server, replica: str) -> RedisRegistry:
    return RedisRegistry(connect(spec_of(server)), "t", replica, TTL_S, backoff_s=(0.05, 0.2))


class Heard:
    """What a replica's pool was told to apply, in order, and of replicas gone."""

    def __init__(self):
        self.changes: list[tuple[str, WorkerEntry | None]] = []
        self.gone: list[str] = []

    def __call__(self, worker_id: str, entry: WorkerEntry | None) -> None:
        self.changes.append((worker_id, entry))

    def last(self, worker_id: str):
        return next((e for w, e in reversed(self.changes) if w == worker_id), "none")


@contextlib.asynccontextmanager
async def launched_and_joined(server):
    """Replica a launched the pool with two workers; b joined it."""
    a, b = registry(server, "a"), registry(server, "b")
    heard_a, heard_b = Heard(), Heard()
    await a.start(RECORD, [PREFILL, DECODE], heard_a, heard_a.gone.append)
    await b.start(None, [PREFILL, DECODE], heard_b, heard_b.gone.append)
    assert await eventually(lambda: a.listening.is_set() and b.listening.is_set())
    try:
        yield (a, heard_a), (b, heard_b)
    finally:
        for r in (a, b):
            if r._tasks and not r._tasks[0].done():
                await r.stop()


def test_the_record_round_trips_what_a_replica_needs_to_start_workers_like_the_others():
    back = PoolRecord.from_json(RECORD.to_json())
    assert back == RECORD
    assert back.engine_config() == EngineConfig.from_kwargs("/models/m", block_size=16,
                                                            max_num_seqs=8)
    assert back.pool_spec() == PoolSpec(1, 2)
    assert back.transfer_config() == TransferConfig(timeout_s=7, secret="s3cret")


def test_a_pool_is_registered_once_and_found_by_the_replicas_that_join_it(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, _), (b, _)):
            assert b.record == RECORD
            other = registry(redis_server, "c")
            with pytest.raises(RegistryError, match="another pool is registered"):
                await other.start(replace(RECORD, pool_id="p2"), [], Heard())
            await other.client.aclose()
            record, entries = await asyncio.to_thread(read_registered, spec_of(redis_server))
            assert record == RECORD
            assert sorted(entries, key=lambda e: e.worker_id) == [DECODE, PREFILL]
            assert set(await a.client.zrange(a.routers_key, 0, -1)) == {"a", "b"}
    asyncio.run(scenario())


def test_no_pool_registered_is_a_clear_error_for_a_replica_that_joins(redis_server):
    async def scenario():
        lone = registry(redis_server, "b")
        with pytest.raises(RegistryError, match="no pool is registered under 't'"):
            await lone.start(None, [], Heard())
        await lone.client.aclose()
    asyncio.run(scenario())


def test_each_change_reaches_the_other_replica_and_not_its_own(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, heard_a), (b, heard_b)):
            added = replace(DECODE, worker_id="decode-7", locator="a-d7", generation="g7")
            a.changed(added)
            a.changed(replace(added, draining=True))
            a.changed(replace(DECODE, role="both"))
            a.left("prefill-0")
            assert await eventually(lambda: heard_b.last("prefill-0") is None)
            # changes not yet sent coalesce to each worker's latest; none goes back
            assert heard_b.last("decode-7") == replace(added, draining=True)
            assert [e for w, e in heard_b.changes if w == "decode-7"][-2:] in (
                [replace(added, draining=True)], [added, replace(added, draining=True)])
            assert heard_b.last("decode-1") == replace(DECODE, role="both")
            assert heard_a.changes == []  # its own changes were applied where made
            assert set(await b.entries()) == {"decode-1", "decode-7"}
    asyncio.run(scenario())


def test_a_replica_that_missed_a_message_reads_it_at_its_next_renewal(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, _), (b, heard_b)):
            # written as another replica would, its message lost
            missed = replace(DECODE, draining=True)
            await a.client.hset(a.workers_key, "decode-1", missed.to_json())
            assert await eventually(lambda: heard_b.last("decode-1") == missed,
                                    timeout_s=TTL_S)
    asyncio.run(scenario())


def test_every_key_has_a_ttl_and_the_last_replica_ends_the_pool(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, _), (b, _)):
            assert await a.next_worker_number() == 3  # after the two registered
            for key in (a.pool_key, a.workers_key, a.routers_key, a.seq_key):
                assert 0 < await a.client.pttl(key) <= TTL_S * 1e3, key
            probe = registry(redis_server, "probe")
            assert not await a.stop()  # b still serves the pool
            assert await probe.client.exists(a.pool_key)
            assert await b.stop()  # the last one
            assert await probe.client.keys("t:*") == []
            await probe.client.aclose()
    asyncio.run(scenario())


def test_a_replica_that_stops_renewing_is_told_to_exactly_one_live_replica(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, heard_a), (b, heard_b)):
            c = registry(redis_server, "c")
            await c.start(None, [], Heard())
            for task in c._tasks:  # it dies: no renewal, no sign-off
                task.cancel()
            await asyncio.gather(*c._tasks, return_exceptions=True)
            await c.client.aclose()
            assert await eventually(lambda: heard_a.gone + heard_b.gone == ["c"] or
                                    heard_b.gone + heard_a.gone == ["c"], timeout_s=TTL_S * 2)
            assert "c" not in await a.client.zrange(a.routers_key, 0, -1)
    asyncio.run(scenario())


def test_a_replica_with_a_shorter_ttl_never_shortens_the_pool_s_keys(redis_server):
    """Replicas may run with different --registry-ttl-s. One with a short TTL that dies
    must not take the shared keys with it before the others renew them: the routers'
    set would vanish with its entry, and no replica would ever learn it is gone (its
    requests' KV left held; seen in tests/cluster/test_replicas.py)."""
    async def scenario():
        a = RedisRegistry(connect(spec_of(redis_server)), "t", "a", 30.0,
                          backoff_s=(0.05, 0.2))  # renews every 10 s: not during this test
        heard_a = Heard()
        await a.start(RECORD, [PREFILL], heard_a, heard_a.gone.append)
        b = RedisRegistry(connect(spec_of(redis_server)), "t", "b", 0.5,
                          backoff_s=(0.05, 0.2))
        await b.start(None, [PREFILL], Heard())
        for task in b._tasks:  # it dies: no renewal, no sign-off
            task.cancel()
        await asyncio.gather(*b._tasks, return_exceptions=True)
        await b.client.aclose()
        expiry_ms = await a.client.zscore(a.routers_key, "b")
        assert await eventually(lambda: time.time() * 1e3 > expiry_ms + 100, timeout_s=2)
        for key in (a.pool_key, a.workers_key, a.routers_key, a.seq_key):
            assert await a.client.exists(key), f"{key} went with the replica that died"
        await a._heartbeat()  # the survivor's next renewal
        assert heard_a.gone == ["b"]
        assert await a.stop()
    asyncio.run(scenario())


def test_a_cancellation_swallowed_inside_a_renewal_still_stops_the_replica(redis_server):
    """redis-py can turn a cancellation that races a command's timeout into an error
    (redis/redis-py#2551): the renewals must end all the same, or stop() waits forever
    (it did: a full run hung in the test below for minutes)."""
    async def scenario():
        a = registry(redis_server, "a")
        await a.start(RECORD, [PREFILL], Heard())
        entered, swallow = asyncio.Event(), [True]

        async def swallowing() -> None:  # a heartbeat whose Redis call eats the cancel
            entered.set()
            try:
                await asyncio.Event().wait()  # a command in flight: only a cancel ends it
            except asyncio.CancelledError:
                if swallow[0]:
                    raise RedisError("the cancellation, swallowed") from None
                raise
        a._heartbeat = swallowing
        await asyncio.wait_for(entered.wait(), TTL_S)
        stop = asyncio.ensure_future(a.stop())
        done, _ = await asyncio.wait([stop], timeout=TTL_S)
        swallow[0] = False  # a failing run ends too: the next cancellation goes through
        assert stop in done, "stop() still waits on the renewals"
        assert stop.result()  # the last replica: it ended the pool
    asyncio.run(scenario())


def test_redis_restarted_empty_is_rebuilt_from_the_replicas_views(redis_server):
    async def scenario():
        async with launched_and_joined(redis_server) as ((a, _), (b, heard_b)):
            redis_server.kill()
            drained = replace(DECODE, draining=True)
            a.changed(drained)  # made while Redis is away: kept, sent when it is back
            redis_server.start()
            assert await eventually(lambda: b.listening.is_set(), timeout_s=TTL_S * 2)

            async def rebuilt():
                record, entries = await asyncio.to_thread(read_registered,
                                                          spec_of(redis_server))
                return record == RECORD and sorted(entries, key=lambda e: e.worker_id) \
                    == [drained, PREFILL]
            assert await eventually(rebuilt, timeout_s=TTL_S * 2)
            assert await eventually(lambda: heard_b.last("decode-1") == drained,
                                    timeout_s=TTL_S * 2)
    asyncio.run(scenario())
