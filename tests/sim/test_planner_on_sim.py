"""The SLO planner in the loop, on simulated workers in virtual time: the real Router,
Pool and PlannerRunner, with `--autoscale`. A load step grows the pools it needs;
when the load stops they return to their minima; no request is lost to scaling."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from pdserve import SamplingParams
from pdserve.router.config import AutoscaleSpec, PoolSpec, RouterConfig, RoutingSpec
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from tests.sim.sims import small_profile

MAX_TOKENS = 64


def test_a_load_step_grows_the_pools_and_they_shrink_back_when_it_stops():
    # 40 req/s of 1,000-token prompts: a prefill worker computes one in ~54 ms, so the
    # demand is ~2.5 prefill workers at the SLO; the decodes at once at 20 ms a step,
    # ~1.3 decode workers. Bounds: 1..3 each, 6 in all. A new worker takes 3 s to load.
    config = RouterConfig(
        max_queued_prefill_tokens=0,  # every request is placed: none refused, none lost
        routing=RoutingSpec(admission="always", slo_ttft_ms=500, slo_tpot_ms=20),
        autoscale=AutoscaleSpec(autoscale=True, min_prefill_workers=1, max_prefill_workers=3,
                                min_decode_workers=1, max_decode_workers=3, max_workers=6,
                                planner_interval_s=1.0))

    async def scenario():
        cluster = SimCluster(replace(small_profile(num_kv_blocks=16384, max_model_len=2048),
                                     startup_s=3.0), PoolSpec(1, 1), config)
        router = await cluster.start()
        rng, params = random.Random(0), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True)
        loop = asyncio.get_running_loop()
        sizes: list[tuple[int, int]] = []  # (prefill, decode) serving, at every change
        back = asyncio.Event()  # both pools at their minima again

        def serving(role: str) -> int:
            states = router.worker_states()
            return sum(w.state.role == role and states[k] == "serving"
                       for k, w in router.workers.items())

        def changed() -> None:
            sizes.append((serving("prefill"), serving("decode")))
            if sizes[-1] == (1, 1) and len(router.workers) == 2 and requests_done.is_set():
                back.set()
        router.on_change.append(changed)
        requests_done = asyncio.Event()

        async def one(i: int):
            prompt = [rng.randrange(4, 2000) for _ in range(1000)]
            accepted = await router.accept(prompt, params, f"r{i}")
            return [d async for d in router.generate(accepted)][-1]

        requests, start = [], loop.time()
        while loop.time() - start < 60.0:  # the load: Poisson arrivals at 40 req/s
            requests.append(asyncio.ensure_future(one(len(requests))))
            await asyncio.sleep(rng.expovariate(40.0))
        finished = await asyncio.gather(*requests)
        requests_done.set()
        changed()
        await asyncio.wait_for(back.wait(), 240.0)  # virtual seconds: the planner shrinks
        await router.planner.settled()
        decisions = list(router.planner.decisions)
        started = list(router.pool.startup_times)  # asked for -> serving, each added one
        await cluster.stop()
        return finished, sizes, decisions, started

    finished, sizes, decisions, started = virtual_time.run(scenario())
    assert started and min(started) >= 3.0  # the profile's start-up is waited out
    assert {d.finish_reason for d in finished} == {"length"}  # none lost to scaling
    grown = [(d["action"], d["role"]) for d in decisions if d["action"] in ("add", "flip")]
    assert ("add", "prefill") in grown and ("add", "decode") in grown, decisions
    assert all(d["outcome"] in ("started", "done") for d in decisions), decisions
    peak = max(p for p, _ in sizes), max(d for _, d in sizes)
    assert peak[0] >= 2 and peak[1] >= 2 and peak[0] <= 3 and peak[1] <= 3
    assert sizes[-1] == (1, 1)  # back to the minimum
    shrunk = [d for d in decisions if d["action"] == "remove"]
    assert shrunk and all(d["cause"] == "spare" for d in shrunk)
