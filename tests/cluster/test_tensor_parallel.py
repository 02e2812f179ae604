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
    assert profile.step_cost.prefill_token_s > 0
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
