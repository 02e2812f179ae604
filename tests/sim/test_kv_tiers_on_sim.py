"""Host memory's tiers in the simulator: simulated workers run the same scheduler
with a swap area and a host prefix tier, each copy at the profile's
host_copy_s_per_block. Sessions whose histories the device cache cannot keep while
their users think find them in the host tier; a swap-preempting worker resumes its
victims from host memory. Virtual time: the same figures every run."""
from __future__ import annotations

import statistics
from dataclasses import replace

from pdserve.bench.metrics import SLO
from pdserve.bench.sessions import SessionShape
from pdserve.bench.workloads import make_workload
from pdserve.engine.config import SchedulerConfig
from pdserve.router.config import PoolSpec
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster, host_blocks
from pdserve.sim.driver import Load, drive
from tests.sim.sims import small_profile

PROFILE = replace(small_profile(num_kv_blocks=96, max_model_len=1024),
                  host_copy_s_per_block=20e-6)
GIB_PER_BLOCK = PROFILE.kv_bytes_per_block / (1 << 30)


def sessions(scheduler: SchedulerConfig = SchedulerConfig(), host_gib=(0.0, 0.0)):
    def draw():
        return make_workload("sessions", 16, PROFILE.vocab_size, seed=3, scale=0.04,
                             sessions=SessionShape(mean_turns=5, think_s=2.0,
                                                   max_model_len=PROFILE.max_model_len))

    async def scenario():
        cluster = SimCluster(PROFILE, PoolSpec(1, 0, mode="colocated"), scheduler=scheduler,
                             host_gib=host_gib)
        router = await cluster.start()
        try:
            records, _ = await drive(router, draw(), Load(request_rate=4.0,
                                                          slo=SLO(ttft_ms=2000, tpot_ms=200)))
            return records, [w.scheduler.stats for w in cluster.workers.values()]
        finally:
            await cluster.stop()
    return virtual_time.run(scenario())


def test_sessions_find_their_history_in_the_host_tier_sooner_than_recomputed():
    records, _ = sessions()
    tiered, stats = sessions(host_gib=(0.0, 4096 * GIB_PER_BLOCK))
    assert all(r.ok for r in records + tiered)
    later = [r for r in tiered if r.turn >= 2]
    assert sum(r.num_host_cached_tokens for r in later) > 0
    assert stats[0].host_prefix_cache_hits > 0
    assert all(r.num_host_cached_tokens == 0 for r in tiered if r.turn == 1)
    assert sum(r.num_cached_tokens for r in later) > sum(
        r.num_cached_tokens for r in records if r.turn >= 2)

    def p50(rs):
        return statistics.median(r.first_output_time - r.send_time for r in rs
                                 if r.turn >= 2)
    assert p50(tiered) < p50(records)


def test_a_swap_preempting_worker_resumes_victims_from_host_memory():
    """Prompts admitted while they fit, then outgrowing the cache as they decode."""
    def preempting(mode: str):
        async def scenario():
            cluster = SimCluster(PROFILE, PoolSpec(1, 0, mode="colocated"),
                                 scheduler=SchedulerConfig(preemption_mode=mode),
                                 host_gib=(4096 * GIB_PER_BLOCK, 0.0))
            router = await cluster.start()
            try:
                records, _ = await drive(
                    router, make_workload("random", 24, PROFILE.vocab_size, seed=1,
                                          input_len=200, output_len=300), Load(request_rate=50))
                return records, cluster.workers["both-0"].scheduler.stats
            finally:
                await cluster.stop()
        return virtual_time.run(scenario())
    records, recompute = preempting("recompute")
    swapped_records, swap = preempting("swap")
    assert all(r.ok for r in records + swapped_records)
    assert recompute.num_preemptions > 0 and recompute.num_swapped_out == 0
    assert swap.num_swapped_out > 0 and swap.num_swapped_in == swap.num_swapped_out


def test_host_memory_in_blocks_is_per_device_over_a_rank_s_share_of_a_block():
    two = replace(PROFILE, tensor_parallel_size=2)
    assert host_blocks(PROFILE, 10 * GIB_PER_BLOCK, GIB_PER_BLOCK) == (10, 1)
    assert host_blocks(two, 10 * GIB_PER_BLOCK, GIB_PER_BLOCK) == (20, 2)
