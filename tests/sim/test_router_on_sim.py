"""The real Router against simulated workers through the WorkerClient seam, without
Ray, in virtual time: exact token streams (the workers running the real tiny model),
aborts, refusals, and the ordered wait for capacity."""
from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.errors import OverloadedError
from pdserve.router.slo import Slo
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from pdserve.sim.tokens import ModelTokens
from tests.sim.sims import model_profile, small_profile

MAX_TOKENS = 12


async def _tokens(router, prompt, params, request_id="", slo=Slo()):
    accepted = await router.accept(prompt, params, request_id, slo=slo)
    deltas = [d async for d in router.generate(accepted)]
    return [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


def _all_free(cluster: SimCluster) -> bool:
    return all(w.blocks.num_free_blocks == w.blocks.num_blocks and not w.scheduler.requests
               for w in cluster.workers.values())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "adaptive"])
def test_token_streams_through_simulated_workers_equal_the_engine_s(llama_dir, mode):
    """Greedy streams of the real model on simulated workers, concurrent, with chunked
    prefill and prompts that share a prefix (the decode side's own hits are not sent):
    the offline engine's outputs (exact against HF, tests/engine)."""
    shared = list(range(100, 164))  # four full blocks
    prompts = [shared + [7, 8, 9], shared + [10, 11], list(range(300, 340)), [5, 6, 7],
               list(range(500, 597))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(llama_dir), num_kv_blocks=256, max_model_len=512)
                .generate(prompts, params)]

    async def scenario():
        cluster = SimCluster(model_profile(llama_dir), PoolSpec(1, 1, mode=mode),
                             scheduler=SchedulerConfig(long_prefill_token_threshold=32),
                             tokens=lambda worker_id: ModelTokens.load(str(llama_dir), 256, 16,
                                                                       512),
                             tokenizer=Tokenizer(llama_dir))
        router = await cluster.start()
        first = await _tokens(router, prompts[0], params)  # its blocks cached first
        rest = await asyncio.gather(*[_tokens(router, p, params) for p in prompts[1:]])
        await asyncio.sleep(1.0)
        free = _all_free(cluster)
        await cluster.stop()
        return [first, *rest], free, router.num_inflight
    outs, free, inflight = virtual_time.run(scenario())
    assert [tokens for tokens, _ in outs] == expected
    assert {reason for _, reason in outs} == {"length"}
    assert free and inflight == 0


def test_an_abort_ends_the_stream_and_frees_every_block():
    async def scenario():
        cluster = SimCluster(small_profile(), PoolSpec(1, 1))
        router = await cluster.start()
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        accepted = await router.accept(list(range(10, 200)), params, "doomed")
        stream = router.generate(accepted)
        seen = []
        async for delta in stream:
            seen.append(delta)
            if sum(len(d.token_ids) for d in seen) >= 5 and not delta.finished:
                assert await router.abort("doomed")
        await asyncio.sleep(1.0)
        free = _all_free(cluster)
        await cluster.stop()
        return seen, free, router.num_inflight
    seen, free, inflight = virtual_time.run(scenario())
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert 5 <= sum(len(d.token_ids) for d in seen) < 500
    assert free and inflight == 0


def test_refusals_are_typed_and_leave_nothing_held():
    """A request the KV cache can never hold is the worker's 400; under a burst on a
    small cache with a tight TTFT SLO some are refused (429) and the rest finish.
    Forecasts are held to the SLO itself (no headroom): the refusals here are the KV
    cache's."""
    async def scenario():
        cluster = SimCluster(small_profile(num_kv_blocks=40), PoolSpec(1, 1),
                             RouterConfig(routing=RoutingSpec(ttft_headroom=1.0)))
        router = await cluster.start()
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        with pytest.raises(InvalidRequestError) as never:
            await _tokens(router, list(range(10, 20)),
                          SamplingParams(max_tokens=900, ignore_eos=True))
        burst = await asyncio.gather(*[
            _tokens(router, list(range(10 + i, 300 + i)), params, slo=Slo(ttft_s=0.2))
            for i in range(12)], return_exceptions=True)
        await asyncio.sleep(1.0)
        free = _all_free(cluster)
        traffic = router.traffic.traffic(router.clock.monotonic())
        await cluster.stop()
        return never.value, burst, free, router.num_inflight, traffic
    never, burst, free, inflight, traffic = virtual_time.run(scenario())
    assert never.field == "max_tokens" and "KV blocks" in str(never)
    refused = [r for r in burst if isinstance(r, OverloadedError)]
    served = [r for r in burst if isinstance(r, tuple)]
    assert refused and served and len(refused) + len(served) == len(burst)
    assert all(len(tokens) == 16 for tokens, _ in served)
    assert free and inflight == 0
    # What the planner reads: each served request judged by the prefill pool on its
    # TTFT (the decode pool's TPOT has no target here), each refused one (no worker
    # had room) a miss of both pools; the 400 is no one's.
    assert {str(r) for r in refused} == {"no worker can take this request now"}
    (met_p, judged_p), (met_d, judged_d) = (traffic.attainment(r) for r in ("prefill", "decode"))
    assert (judged_p, judged_d) == (len(served) + len(refused), len(refused))
    assert judged_p - met_p >= len(refused) and met_d == 0


def test_requests_waiting_for_capacity_are_placed_in_deadline_order():
    """One worker whose KV holds one long request at a time: three more arrive and
    wait (their TTFT SLOs leave time); as capacity frees they are placed earliest
    deadline first, not in arrival order."""
    async def scenario():
        cluster = SimCluster(small_profile(num_kv_blocks=24), PoolSpec(0, 1, mode="colocated"),
                             RouterConfig(routing=RoutingSpec(admission="slo")))
        router = await cluster.start()
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        placed = []

        async def one(name, offset, slo):
            accepted = await router.accept(list(range(offset, offset + 300)), params, name,
                                           slo=slo)
            async for delta in router.generate(accepted):
                if delta.token_ids and name not in placed:
                    placed.append(name)
        holder = asyncio.ensure_future(one("first", 10, Slo()))
        while not placed:
            await asyncio.sleep(0.01)
        waiters = [asyncio.ensure_future(one(name, offset, Slo(ttft_s=ttft)))
                   for name, offset, ttft in (("lax", 400, 60.0), ("urgent", 800, 20.0),
                                              ("middle", 1200, 40.0))]
        await asyncio.sleep(0.001)
        waiting = len(router.placer.queue)
        await asyncio.gather(holder, *waiters)
        await cluster.stop()
        return placed, waiting, router.metrics
    placed, waiting, metrics = virtual_time.run(scenario())
    assert waiting == 3
    assert placed == ["first", "urgent", "middle", "lax"]
    assert metrics.registry.get_sample_value(
        "pdserve:router_placement_waiters_total",
        {"model_name": "test", "outcome": "placed"}) == 3


def test_pairs_follow_membership_and_close_when_a_receiver_leaves_or_flips():
    """Pool bookkeeping of the KV pairs, on the simulated workers (each keeps the set
    of receivers it holds a pair with, as a real worker's KVSender does): a decode
    worker that joins is paired with every prefill worker; once it flips to prefill
    or leaves, none keeps a pair with it, and a worker that flips to decode keeps no
    pair as a sender. The same pairs on Ray, counted in threads and fds:
    tests/cluster/test_membership.py."""
    async def scenario():
        cluster = SimCluster(small_profile(), PoolSpec(2, 1))
        router = await cluster.start()
        pool, params = router.pool, SamplingParams(max_tokens=4, temperature=0)
        senders = lambda: [w for w in cluster.workers.values() if w.role == "prefill"]  # noqa: E731
        await asyncio.gather(*[_tokens(router, list(range(10, 60)), params) for _ in range(4)])
        seen = {"served": {w.worker_id: set(w.paired) for w in senders()}}
        new = await pool.add("decode")
        seen["joined"] = {w.worker_id: set(w.paired) for w in senders()}
        await pool.set_role(new, "prefill")
        seen["flipped"] = {w.worker_id: set(w.paired) for w in senders()}
        await pool.set_role(new, "decode")
        seen["back"] = {w.worker_id: set(w.paired) for w in senders()}
        seen["new back"] = set(cluster.workers[new].paired)
        await pool.remove(new)
        seen["removed"] = {w.worker_id: set(w.paired) for w in senders()}
        await cluster.stop()
        return new, seen
    new, seen = virtual_time.run(scenario())
    assert set(seen["served"]) == {"prefill-0", "prefill-1"}
    assert all(paired == {"decode-0"} for paired in seen["served"].values()), seen
    assert all(paired == {"decode-0", new} for paired in seen["joined"].values()), seen
    assert seen["flipped"] == {"prefill-0": {"decode-0"}, "prefill-1": {"decode-0"},
                               new: {"decode-0"}}, seen
    assert all(paired == {"decode-0", new} for paired in seen["back"].values()), seen
    assert seen["new back"] == set()
    assert all(paired == {"decode-0"} for paired in seen["removed"].values()), seen


def test_an_add_that_does_not_wait_names_the_worker_at_once_and_shows_it_starting():
    async def scenario():
        cluster = SimCluster(small_profile(), PoolSpec(1, 1))
        router = await cluster.start()
        pool = router.pool
        worker_id = await pool.add("decode", wait=False)
        at_once = (pool.joining[worker_id].state, worker_id in pool.workers)
        joined = asyncio.Event()
        pool.on_change.append(joined.set)
        await asyncio.wait_for(joined.wait(), 60)
        after = (worker_id in pool.joining, pool.states().get(worker_id))
        await cluster.stop()
        return worker_id, at_once, after
    worker_id, at_once, after = virtual_time.run(scenario())
    assert worker_id == "decode-1"
    assert at_once == ("starting", False)  # booting: not a member yet
    assert after == (False, "serving")


def test_a_split_request_s_usage_counts_its_prefill_worker_s_prefix_hit(monkeypatch):
    """Turn 1 runs whole on worker a (its 6 prompt blocks cached there); turn 2, turn
    1's prompt and more, is split: prefilled on a, where the 96 tokens are a hit, and
    decoded on b, which received its KV and cached nothing of its own. Its usage
    counts the hit (the decode worker's count alone said 0: a cluster test saw it)."""
    from pdserve.router import placer as placer_module
    from pdserve.router.policy.decision import Colocate, Disaggregate

    first = list(range(100, 196))  # 6 full blocks
    second = first + list(range(400, 440))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def scenario():
        cluster = SimCluster(small_profile(), PoolSpec(1, 1, mode="adaptive"))
        router = await cluster.start()
        a, b = sorted(router.workers)
        placements = iter([Colocate(a), Disaggregate(a, b)])
        monkeypatch.setattr(placer_module, "decide", lambda view, state, policy: next(placements))
        usages = []
        for prompt in (first, second):
            accepted = await router.accept(prompt, params, "")
            deltas = [d async for d in router.generate(accepted)]
            usages.append(deltas[-1].num_cached_tokens)
        await cluster.stop()
        return usages
    assert virtual_time.run(scenario()) == [0, 96]
