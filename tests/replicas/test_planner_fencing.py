"""The planner carries an action out only while the lease still holds the token it
decided under (a real Redis): one decided before another replica took the lease over
is recorded as fenced and not carried out."""
from __future__ import annotations

import asyncio

from pdserve.router.config import AutoscaleSpec, RouterConfig, SharedStateSpec
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner.core import Action
from pdserve.router.planner.runner import PlannerRunner
from pdserve.router.planner.traffic import TrafficWindow
from pdserve.router.pool.pool import Pool
from pdserve.router.replicas.leader_lease import RedisLease
from pdserve.router.replicas.redis_client import connect
from pdserve.router.slo import Slo
from tests.polling import eventually


def test_an_action_decided_under_a_lost_lease_is_fenced(redis_server):
    async def scenario():
        spec = SharedStateSpec(redis_url=redis_server.url, redis_prefix="t")
        lease = RedisLease(connect(spec), "t", "a", ttl_s=5.0)
        await lease.start()
        assert await eventually(lambda: lease.leading)
        token = lease.token
        runner = PlannerRunner(Pool(RouterConfig(), "router-a"),
                               AutoscaleSpec(autoscale=True).planner_config(
                                   ("prefill", "decode")),
                               Slo(), TrafficWindow(), RouterMetrics("m"), lease)
        carried: list[str] = []

        async def add():
            carried.append("add")
            return "prefill-9"
        action = Action("add", "prefill", "demand", "test")
        leader_key = lease.keys[0]
        await lease.client.set(leader_key, f"b\n{token + 1}")  # another replica leads
        fenced = {"outcome": "under way"}
        await runner._settle(fenced, action, add, token)
        assert fenced["outcome"].startswith("fenced") and carried == []
        await lease.client.set(leader_key, f"a\n{token}")  # its own again
        done = {"outcome": "under way"}
        await runner._settle(done, action, add, token)
        assert done["outcome"] == "started" and carried == ["add"]
        await lease.stop()
    asyncio.run(scenario())
