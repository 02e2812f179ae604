"""One planner per cluster: the leader lease in a real Redis. One holder at a time;
another takes over within the TTL when the leader stops or dies; fencing tokens only
grow, so a planner that lost the lease cannot act; Redis lost pauses every planner."""
from __future__ import annotations

import asyncio

from pdserve.router.config import SharedStateSpec
from pdserve.router.replicas.leader_lease import RedisLease
from pdserve.router.replicas.redis_client import connect
from tests.polling import eventually

TTL_S = 1.0


def lease(server, holder: str) -> RedisLease:
    spec = SharedStateSpec(redis_url=server.url, redis_prefix="t", leader_ttl_s=TTL_S)
    return RedisLease(connect(spec), spec.redis_prefix, holder, TTL_S)


def test_one_leads_and_another_takes_over_when_it_stops(redis_server):
    async def scenario():
        a, b = lease(redis_server, "a"), lease(redis_server, "b")
        await a.start()
        assert await eventually(lambda: a.leading)
        await b.start()
        assert await eventually(lambda: b.rounds >= 2)
        assert b.token == 0 and not b.leading and a.leading
        first = a.token
        assert await a.still_leading(first) and not await b.still_leading(first)
        await a.stop()  # lets go at once
        assert await eventually(lambda: b.leading, timeout_s=2 * TTL_S)
        assert b.token > first and not a.leading
        await b.stop()
    asyncio.run(scenario())


def test_a_dead_leader_is_replaced_within_the_ttl_and_fenced_out(redis_server):
    async def scenario():
        a, b = lease(redis_server, "a"), lease(redis_server, "b")
        await a.start()
        assert await eventually(lambda: a.leading)
        token = a.token
        a._renewing.cancel()  # it dies: no renewal, no letting go
        await b.start()
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert await eventually(lambda: b.leading, timeout_s=3 * TTL_S)
        assert loop.time() - began < 2 * TTL_S
        assert not await a.still_leading(token)  # its actions are refused from now on
        assert not a.leading  # and its own view ran out with its last renewal
        await b.stop()
        await a.client.aclose()
    asyncio.run(scenario())


def test_redis_lost_pauses_every_planner_and_one_leads_again_when_it_returns(
        redis_server):
    async def scenario():
        a, b = lease(redis_server, "a"), lease(redis_server, "b")
        await a.start()
        await b.start()
        assert await eventually(lambda: a.leading or b.leading)
        leader = a if a.leading else b
        token = leader.token
        assert await leader.still_leading(token)
        redis_server.kill()
        assert await eventually(lambda: not a.leading and not b.leading, timeout_s=2 * TTL_S)
        assert not await leader.still_leading(token)  # no answer is no lead
        redis_server.start()
        assert await eventually(lambda: a.leading != b.leading, timeout_s=3 * TTL_S)
        await a.stop()
        await b.stop()
    asyncio.run(scenario())
