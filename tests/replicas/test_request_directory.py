"""The request directory several router replicas share in Redis (a real
redis-server): ownership claimed and refused across replicas, aborts forwarded to the
holder, entries bounded by their TTL, and Redis lost and back without a failed call."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from pdserve.router.config import SharedStateSpec
from pdserve.router.replicas.redis_client import connect
from pdserve.router.replicas.redis_directory import RedisDirectory
from tests.polling import eventually

TTL_S = 3.0


def directory(server, replica: str, ttl_s: float = TTL_S) -> RedisDirectory:
    spec = SharedStateSpec(redis_url=server.url, redis_prefix="t", request_ttl_s=ttl_s)
    return RedisDirectory(connect(spec), spec.redis_prefix, replica, ttl_s,
                          backoff_s=(0.05, 0.2))


@contextlib.asynccontextmanager
async def two(server):
    """Replicas a and b over one Redis, stopped (their entries released) at the end."""
    a, b = directory(server, "a"), directory(server, "b")
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def test_an_id_one_replica_holds_is_refused_to_another_until_released(redis_server):
    async def scenario():
        async with two(redis_server) as (a, b):
            assert await a.claim("r1", "alice")
            assert not await b.claim("r1", "alice")
            ttl = await a.client.ttl(a.key("r1"))
            assert 0 < ttl <= TTL_S
            assert (await a.client.get(a.key("r1"))).split("\n")[:2] == ["a", "alice"]
            a.release("r1")
            assert await eventually(lambda: b.claim("r1", "bob"))
    asyncio.run(scenario())


def test_an_abort_reaching_another_replica_is_forwarded_to_the_holder(redis_server):
    async def scenario():
        async with two(redis_server) as (a, b):
            heard: list[tuple[str, str]] = []
            got = asyncio.Event()

            def abort_here(request_id, owner):
                heard.append((request_id, owner))
                got.set()
                return True
            await a.start(abort_here)
            await b.start(lambda *_: False)
            await asyncio.wait_for(a.listening.wait(), 10)
            assert await a.claim("r1", "alice")
            assert not await b.forward_abort("r1", "mallory")  # another caller's request
            assert not await b.forward_abort("nope", "alice")
            assert not await a.forward_abort("r1", "alice")  # its own: the router looked
            assert await b.forward_abort("r1", "alice")
            await asyncio.wait_for(got.wait(), 10)
            assert heard == [("r1", "alice")]
    asyncio.run(scenario())


def test_a_replica_s_entries_end_with_their_ttl_unless_renewed(redis_server):
    async def scenario():
        a, b = directory(redis_server, "a", ttl_s=1.0), directory(redis_server, "b")
        await a.start(lambda *_: False)  # renews every third of a second
        assert await a.claim("kept", "x")
        dead = directory(redis_server, "dead", ttl_s=1.0)  # never started: no renewals
        assert await dead.claim("orphan", "x")
        assert await eventually(lambda: b.claim("orphan", "y"), timeout_s=5)
        assert not await b.claim("kept", "y")  # renewed past its first TTL
        await a.stop()
        assert await b.claim("kept", "y")  # released on stop
        await b.stop()
        await dead.client.aclose()
    asyncio.run(scenario())


def test_a_late_release_does_not_delete_a_re_claim_of_the_same_id(redis_server):
    async def scenario():
        async with two(redis_server) as (a, b):
            assert await a.claim("r1", "alice")
            stale = a._held["r1"]
            a.release("r1")
            await a.flushed()
            assert await a.claim("r1", "alice")  # the same id and owner again
            await a._delete_many({"r1": stale})  # a late release of the first claim
            assert not await b.claim("r1", "bob")  # the second claim still holds
    asyncio.run(scenario())


def test_a_release_that_missed_redis_leaves_an_entry_its_replica_may_take_again(
        redis_server):
    async def scenario():
        async with two(redis_server) as (a, b):
            assert await a.claim("r1", "alice")
            a._held.pop("r1")  # as if its release had failed: the entry stays
            assert not await b.claim("r1", "bob")
            assert await a.claim("r1", "alice")
    asyncio.run(scenario())


def test_redis_lost_and_back_fails_no_call_and_the_directory_is_rebuilt(redis_server):
    async def scenario():
        async with two(redis_server) as (a, b):
            got = asyncio.Event()
            await a.start(lambda request_id, owner: got.set() or True)
            await b.start(lambda *_: False)
            await asyncio.wait_for(a.listening.wait(), 10)
            assert await a.claim("before", "alice")
            redis_server.kill()
            # unreachable: claims are granted on each replica's own view, aborts find nothing
            assert await a.claim("during", "alice") and await b.claim("during", "bob")
            assert not await b.forward_abort("before", "alice")
            assert not a.redis.reachable and not b.redis.reachable
            assert await eventually(lambda: not a.listening.is_set())
            b.release("during")
            redis_server.start()  # empty: the entries were in memory only
            # the holders' renewals set their entries again, and the listener resubscribes
            assert await eventually(lambda: redis_server_has(a, "before"))
            assert await eventually(lambda: redis_server_has(a, "during"))
            await asyncio.wait_for(a.listening.wait(), 10)
            assert not await b.claim("before", "bob")
            assert await b.forward_abort("before", "alice")
            await asyncio.wait_for(got.wait(), 10)
            assert a.redis.reachable and b.redis.reachable
    asyncio.run(scenario())


async def redis_server_has(d: RedisDirectory, request_id: str) -> bool:
    try:
        return await d.client.get(d.key(request_id)) is not None
    except Exception:
        return False


def test_a_redis_that_does_not_answer_costs_one_timeout_not_one_per_request(redis_server):
    """SIGSTOP: connections hang rather than fail. The claim that finds out waits the
    call timeout; the next ones do not ask Redis until it answers a PING again."""
    async def scenario():
        a = directory(redis_server, "a")
        await a.start(lambda *_: False)
        await asyncio.wait_for(a.listening.wait(), 10)
        loop = asyncio.get_running_loop()
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            began = loop.time()
            assert await a.claim("first", "x")
            found_out_s = loop.time() - began
            began = loop.time()
            assert all([await a.claim(f"next-{i}", "x") for i in range(20)])
            next_s = loop.time() - began
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert found_out_s >= 0.4 and not a.redis.reachable  # the 0.5 s call timeout
        assert next_s < 0.25  # 20 claims without a Redis call
        assert await eventually(lambda: a.redis.reachable)  # its PING answered again
        assert await eventually(lambda: redis_server_has(a, "next-7"))  # renewed in
        await a.stop()
    asyncio.run(scenario())
