"""Tensor-parallel ranks placed by Ray: the offline LLM's ranks are actors in one
STRICT_PACK placement group, its greedy outputs equal HF's, and shutdown leaves no
rank actor or placement group behind."""
from __future__ import annotations

import pytest
import ray
from ray.exceptions import RayActorError
from ray.util import placement_group_table

from pdserve import LLM
from tests.engine.test_hf_oracle import Oracle, assert_matches_hf, random_prompts, run


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_offline_ranks_in_a_placement_group_equal_hf(ray_local, model_dirs, name):
    llm = LLM(str(model_dirs[name]), kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    ranks = llm._ranks
    placement = placement_group_table(ranks.placement)
    assert placement["strategy"] == "STRICT_PACK" and len(placement["bundles"]) == 2
    assert placement["state"] == "CREATED"
    [rank1] = ranks.actors
    try:
        prompts = random_prompts(llm.engine.model_config.vocab_size, seed=5)
        assert_matches_hf(llm, Oracle(model_dirs[name]), prompts, run(llm, prompts))
        assert ranks.lost() == []  # rank 1 still serving
    finally:
        llm.shutdown()
    assert placement_group_table(ranks.placement)["state"] == "REMOVED"
    with pytest.raises(RayActorError):  # the rank's actor is gone
        ray.get(rank1.__ray_ready__.remote(), timeout=30)


def test_a_profile_is_measured_on_its_ranks(ray_local, llama_dir, tmp_path):
    """`pdserve profile --tensor-parallel-size 2` times the sharded engine on Ray ranks;
    its blocks are per rank (half the heads: twice the blocks of the budget)."""
    from pdserve.cli import main
    from pdserve.engine.kv_cache import bytes_per_block
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.model_runner import DTYPES
    from pdserve.sim.profile import Profile
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(llama_dir), "--out", str(out), "--repeats", "1",
                 "--max-model-len", "512", "--kv-cache-memory-bytes", str(16 << 20),
                 "--tensor-parallel-size", "2", "--num-threads", "1"]) == 0
    profile = Profile.load(out)
    whole = bytes_per_block(ModelConfig.from_dir(llama_dir), 16, DTYPES["float32"])
    assert profile.tensor_parallel_size == 2 and profile.name.startswith(
        f"{llama_dir.name} on 2 x cpu (")
    assert profile.kv_bytes_per_block == whole
    assert profile.num_kv_blocks == (16 << 20) // (whole // 2)
    cost = profile.step_cost  # a prompt costs something, per token or per pair of them
    assert cost.prefill_token_s > 0 or cost.prefill_pair_s > 0
    assert any("not measured: served workers" in note for note in profile.notes)


def test_a_killed_rank_fails_the_next_step_at_once_and_leaves_nothing(ray_local, llama_dir):
    """Rank 1's process killed (as SIGKILL): rank 0's next collective fails on the
    closed connection instead of waiting, saying what broke; shutdown still removes
    the placement group."""
    from pdserve import SamplingParams
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    placement = llm._ranks.placement
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        assert len(llm.generate([[5, 6, 7]], greedy)[0].token_ids) == 4
        ray.kill(llm._ranks.actors[0], no_restart=True)
        assert ray.wait(llm._ranks._serving, timeout=30)[0]  # its serve() ended: dead
        assert llm._ranks.lost() == [1]
        with pytest.raises(RuntimeError) as failed:
            llm.generate([[5, 6, 7, 8]], greedy)
        assert "tensor_parallel_size 2: a step failed on rank 0, or another rank failed " \
            "or was lost" in "\n".join(failed.value.__notes__)
    finally:
        llm.shutdown()
    assert placement_group_table(placement)["state"] == "REMOVED"


@pytest.mark.parametrize("prefill,decode", [(2, 1), (1, 2)])
def test_served_workers_of_two_tensor_parallel_sizes_equal_hf_through_sdk_and_http(
        ray_local, llama_dir, prefill, decode):
    """A prefill worker of TP `prefill` hands each prompt's KV to a decode worker of TP
    `decode`, every rank sending or receiving its own heads (kv_transfer/heads.py).
    Each tensor-parallel worker is one STRICT_PACK placement group, its actor in
    bundle 0; killing the workers removes it."""
    import openai

    from pdserve.engine.config import EngineConfig
    from pdserve.kv_transfer import TransferConfig
    from pdserve.router.config import PoolSpec
    from pdserve.router.front.server import RouterServer
    from pdserve.router.launch import launch
    from tests.cluster.conftest import generate_concurrently, stop_cluster, wait_all_blocks_free

    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512, long_prefill_token_threshold=32)
    router = launch(config, PoolSpec(1, 1, num_cpus_per_worker=0.5,
                                     prefill_tensor_parallel_size=prefill,
                                     decode_tensor_parallel_size=decode),
                    TransferConfig(timeout_s=30), served_model_name="tp")
    srv = RouterServer(router)
    workers = list(router.workers.values())
    placements = [w.client.placement for w in workers if w.client.placement is not None]
    try:
        assert len(placements) == 1
        table = placement_group_table(placements[0])
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        oracle = Oracle(llama_dir)
        prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate([3, 20, 45, 70])]
        for prompt, out in zip(prompts, generate_concurrently(srv, prompts, 8)):
            assert out.token_ids == oracle.generate(prompt, 8)[0]
        client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", timeout=60,
                               max_retries=0)
        for prompt in prompts[1:3]:
            out = client.completions.create(model="tp", prompt=prompt, max_tokens=8,
                                            temperature=0, extra_body={
                                                "ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].model_extra["token_ids"] == oracle.generate(prompt, 8)[0]
        wait_all_blocks_free(srv)
    finally:
        stop_cluster(srv)
    assert placement_group_table(placements[0])["state"] == "REMOVED"


def test_a_sigkilled_rank_takes_its_worker_out_and_every_stream_completes_exactly(
        ray_local, llama_dir):
    """Rank 1 of a decode worker of TP 2 SIGKILLed while streams run on that worker:
    the worker leaves service at once (its rank 0 ends too), every stream completes
    exactly by replay on the other decode worker, and Ray restarts the worker in its
    placement group with a whole new group of ranks. Afterwards nothing is left."""
    import os
    import signal
    import threading

    import httpx

    from pdserve import SamplingParams
    from pdserve.client import Client
    from pdserve.router.front.auth import ApiKeys
    from pdserve.router.front.server import RouterServer
    from tests.cluster.conftest import stop_cluster
    from tests.polling import until

    key = "admin-secret"
    router = two_decoders_of_tp_2(llama_dir)
    srv = RouterServer(router, admin_keys=ApiKeys((key,)))
    decoders = [w for w in router.workers.values() if w.state.role == "decode"]
    victim, other = decoders
    placements = [w.client.placement for w in decoders]

    def admin(path: str) -> int:
        return httpx.post(f"{srv.http_url}/admin{path}", timeout=120,
                          headers={"Authorization": f"Bearer {key}"}).status_code
    try:
        long = dict(max_tokens=300, temperature=0, ignore_eos=True)
        prompts = [list(range(10 + 7 * i, 30 + 11 * i)) for i in range(3)]
        reference = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20, max_model_len=512)
        exact = [o.token_ids for o in reference.generate(prompts, SamplingParams(**long))]
        before = ray.get(victim.client.actor.stats.remote())
        assert len(before["rank_pids"]) == 1
        outputs, failures, started = {}, [], threading.Event()

        def stream(i: int) -> None:
            with Client(srv.grpc_target) as client:
                try:
                    tokens = []
                    for chunk in client.generate_stream(prompts[i], timeout=120, **long):
                        tokens += chunk.token_ids
                        started.set()
                    outputs[i] = tokens
                except Exception as exc:  # noqa: BLE001 - asserted on
                    failures.append(exc)
        assert admin(f"/workers/{other.worker_id}/drain") == 200  # the victim takes them
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert started.wait(60)
        assert admin(f"/workers/{other.worker_id}/resume") == 200
        os.kill(before["rank_pids"][0], signal.SIGKILL)
        for t in threads:
            t.join(150)
        assert not failures and [outputs.get(i) for i in range(3)] == exact

        def replaced() -> bool:  # the same worker, restarted with a new group
            try:
                now = ray.get(victim.client.actor.stats.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - still restarting
                return False
            return now["incarnation"] != before["incarnation"] and \
                now["rank_pids"] and now["rank_pids"] != before["rank_pids"]
        assert until(replaced, timeout_s=120)
        assert ray.get(victim.client.actor.stats.remote())["free_blocks"] > 0
    finally:
        stop_cluster(srv)
    for placement in placements:
        assert placement_group_table(placement)["state"] == "REMOVED"
    from ray._private import state
    assert until(lambda: not [a for a in state.actors().values()
                       if a["ActorClassName"] == "RankActor" and a["State"] == "ALIVE"],
          timeout_s=30)


def test_a_live_migration_between_tensor_parallel_workers_is_exact(ray_local, llama_dir):
    """Two decode workers of TP 2: one drained while long requests stream on it, so
    each moves live, every rank copying its own KV heads to its peer rank on the
    other worker; every output equals one engine's greedy one, and no block stays."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.client import AsyncClient
    from pdserve.router.front.server import RouterServer
    from pdserve.router.lifecycle import Phase
    from tests import faults
    from tests.cluster.conftest import stop_cluster, wait_all_blocks_free
    from tests.cluster.test_migration import _holding, _live_moves, _moved

    router = two_decoders_of_tp_2(llama_dir)
    srv = RouterServer(router)
    prompts = [[faults.SLOW, *range(20, 20 + n)] for n in (7, 40, 23, 64)]
    tokens = 120
    try:
        for worker in router.pool.decode.values():
            ray.get(worker.client.actor.__ray_call__.remote(faults.slow_sampler, 0.05))
        reference = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20, max_model_len=512)
        exact = [o.token_ids for o in reference.generate(prompts, SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True))]

        async def one(prompt):
            async with AsyncClient(srv.grpc_target, timeout=300) as client:
                return (await client.generate(prompt, max_tokens=tokens, temperature=0,
                                              ignore_eos=True)).token_ids

        async def drain():
            victim = await _holding(srv, "decode", lambda f: f.phase is Phase.STREAMING
                                    and f.num_output_tokens >= 5)
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                router.pool.drain(victim.worker_id), srv.loop))
            srv.loop.call_soon_threadsafe(router.pool.resume, victim.worker_id)

        async def scenario():
            return await asyncio.gather(asyncio.gather(*[one(p) for p in prompts]), drain())
        got, _ = asyncio.run(scenario())
        assert got == exact
        assert _live_moves(srv).get("moved", 0) >= 1
        # each resumed on its target: no move fell back to replay (a worker error)
        assert {reason for (reason, _), n in _moved(srv).items() if n} == {"drain"}
        wait_all_blocks_free(srv, timeout_s=60)
    finally:
        stop_cluster(srv)


def two_decoders_of_tp_2(llama_dir):
    """A cluster of 1 prefill worker and 2 decode workers of 2 ranks each, half a CPU a
    rank (the package's Ray holds it beside the other clusters)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.kv_transfer import TransferConfig
    from pdserve.router.config import PoolSpec, RouterConfig
    from pdserve.router.launch import launch
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    return launch(config, PoolSpec(1, 2, num_cpus_per_worker=0.5,
                                   decode_tensor_parallel_size=2),
                  TransferConfig(timeout_s=30), RouterConfig(stall_timeout_s=10),
                  served_model_name="tp")

