"""Tensor parallelism's sharded model against HF: every rank a thread of this process
(engine/parallel/local.py), joined by a real gloo group (the Ray-placed ranks are
tests/cluster's). Greedy outputs equal HF's in float32 or differ first at a near-tie
(test_hf_oracle's rule)."""
from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import CHUNK
from pdserve.engine.parallel.local import join_threads, threaded_engine
from pdserve.engine.parallel.sharding import Shard, check_tensor_parallel
from pdserve.engine.request import choice_id
from pdserve.engine.tiny_model import TinySpec, make_tiny_model
from tests.engine.test_hf_oracle import (
    MAX_TOKENS,
    Oracle,
    assert_matches_hf,
    greedy,
    random_prompts,
)

KV_BYTES = 16 << 20
# Every projection with a bias: the row-parallel ones (o_proj, down_proj) add theirs once.
LLAMA_BIAS = TinySpec(arch="llama", hidden_size=96, intermediate_size=192, num_layers=2,
                      num_heads=6, num_kv_heads=3, max_position_embeddings=1024,
                      init_std=0.08, seed=4, bias=True)


@pytest.fixture(scope="module")
def archs(model_dirs, tmp_path_factory, tokenizer):
    return {**model_dirs, "llama_bias": make_tiny_model(tmp_path_factory.mktemp("bias"),
                                                        LLAMA_BIAS, tokenizer=tokenizer)}


def tp_engine(model_dir, size: int, **engine_args):
    return threaded_engine(EngineConfig.from_kwargs(
        str(model_dir), kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=size,
        **engine_args))


def generate(engine: LLMEngine, prompts) -> list[list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        engine.add_request(str(i), prompt, greedy(n))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs.token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name,size", [("llama_gqa", 2), ("qwen2_tied", 2),
                                       ("llama_gqa", 4), ("qwen2_tied", 4), ("llama_bias", 3)])
def test_sharded_engine_equals_hf(archs, name, size):
    """qwen2_tied has one KV head (replicated on every rank) and tied embeddings
    (one vocabulary split for the lookup and the logits); llama_gqa at 4 ranks holds
    2 query heads and 1 KV head per rank (each KV head on two ranks); llama_bias has
    a bias on every projection, the row-parallel ones added once. Chunked prefill
    and prefix hits (a shared prefix) run sharded too."""
    oracle = Oracle(archs[name])
    with tp_engine(archs[name], size, long_prefill_token_threshold=40) as engine:
        prompts = random_prompts(engine.model_config.vocab_size, seed=3, shared_prefix=20)
        outputs = generate(engine, prompts)
        assert_matches_hf(SimpleNamespace(engine=engine), oracle, prompts, outputs)
        assert engine.runner.model_config.num_heads == engine.model_config.num_heads // size


def test_one_broadcast_and_the_collectives_per_step(llama_dir):
    """A step's description is one broadcast; the model sums twice per layer and once
    for the embedding, of [tokens, hidden] each, and gathers the logits once."""
    with tp_engine(llama_dir, 2) as engine:
        stats = engine.runner.group.stats
        before = (stats.broadcasts, stats.all_reduces, stats.all_reduce_bytes, stats.gathers)
        engine.add_request("a", list(range(10, 47)), greedy(1))
        while engine.has_unfinished():
            engine.step()
        config = engine.model_config
        assert stats.broadcasts - before[0] == 1
        assert stats.all_reduces - before[1] == 2 * config.num_layers + 1
        assert stats.all_reduce_bytes - before[2] == (2 * config.num_layers + 1) * 37 * \
            config.hidden_size * 4
        assert stats.gathers - before[3] == 1


def test_a_description_longer_than_one_chunk_arrives_whole():
    groups = join_threads(3)
    message = {"tables": [list(range(i, i + 700)) for i in range(40)]}  # > CHUNK pickled
    received = []
    threads = [threading.Thread(target=lambda g=g: received.append(g.receive()))
               for g in groups[1:]]
    for t in threads:
        t.start()
    groups[0].broadcast(message)
    for t in threads:
        t.join(timeout=30)
    assert groups[0].stats.broadcast_bytes > CHUNK
    assert received == [message, message]
    for g in groups:
        g.close()


def test_shards_split_heads_and_replicate_kv_heads(model_dirs):
    llama = ModelConfig.from_dir(model_dirs["llama_gqa"])  # 8 heads, 2 KV heads
    four = [Shard.of(llama, 4, r) for r in range(4)]
    assert [(s.first_head, s.num_heads) for s in four] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.first_kv_head, s.num_kv_heads) for s in four] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    two = [Shard.of(llama, 2, r) for r in range(2)]
    assert [(s.first_kv_head, s.num_kv_heads) for s in two] == [(0, 1), (1, 1)]
    rows = [Shard.of(llama, 4, r).vocab_range(llama.vocab_size) for r in range(4)]
    assert rows[0][0] == 0 and rows[-1][1] == llama.vocab_size
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_a_size_the_model_cannot_split_is_refused_naming_the_flag(model_dirs):
    qwen = ModelConfig.from_dir(model_dirs["qwen2_tied"])  # 4 heads, 1 KV head
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide its 4 "
                                         "attention heads"):
        check_tensor_parallel(qwen, 3)
    llama = ModelConfig.from_dir(model_dirs["llama_gqa"])  # 8 heads, 2 KV heads
    check_tensor_parallel(llama, 8)  # a KV head on each of 4 ranks
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs("tiny", tensor_parallel_size=0)


def test_an_engine_without_its_ranks_is_refused(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs a group"):
        LLMEngine(EngineConfig.from_kwargs(str(llama_dir), tensor_parallel_size=2))


def test_a_rank_that_fails_fails_rank_0s_step_at_once(llama_dir, monkeypatch):
    """A rank whose step raises closes its group: rank 0's step raises (it does not
    wait in the collective), and the engine closes without hanging."""
    from pdserve.engine.parallel import follower
    real_run = follower.ModelRunner.run_step

    def fail_on_rank_1(runner, step, *args, **kwargs):
        if runner.group is not None and runner.group.rank == 1:
            raise RuntimeError("injected: rank 1's step")
        return real_run(runner, step, *args, **kwargs)
    monkeypatch.setattr(follower.ModelRunner, "run_step", fail_on_rank_1)
    with pytest.raises(RuntimeError, match="a rank failed: RuntimeError\\(\"injected"):
        with tp_engine(llama_dir, 2) as engine:
            engine.add_request("a", list(range(10, 30)), greedy(4))
            with pytest.raises(RuntimeError):
                engine.step()


def _altered(src, dst, change) -> ModelConfig:
    """A copy of the checkpoint at `src` with `change(tensors)` applied."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    [path] = list(dst.glob("*.safetensors"))
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return ModelConfig.from_dir(dst)


@pytest.mark.parametrize("size,rank", [(1, 0), (2, 1)])
def test_a_checkpoint_of_the_wrong_shape_is_refused_whole_or_sharded(llama_dir, tmp_path,
                                                                     size, rank):
    """Each tensor is checked whole before a rank takes its slice: a slice of a
    too-large tensor would otherwise load quietly."""
    from pdserve.engine.model.loader import load_model
    name = "model.layers.0.self_attn.q_proj.weight"

    def grow(tensors):
        tensors[name] = torch.cat([tensors[name], tensors[name][:16]])
    config = _altered(llama_dir, tmp_path / "grown", grow)
    with pytest.raises(ValueError, match="q_proj.weight' has shape \\(144, 128\\), expected "
                                         "\\(128, 128\\)"):
        load_model(tmp_path / "grown", config, torch.device("cpu"), torch.float32,
                   Shard.of(config, size, rank))

    def short_vocab(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:-3].clone()
    config = _altered(llama_dir, tmp_path / "short", short_vocab)
    with pytest.raises(ValueError, match="lm_head.weight' has shape"):
        load_model(tmp_path / "short", config, torch.device("cpu"), torch.float32,
                   Shard.of(config, size, rank))

    def undeclared_bias(tensors):
        tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(128)
    config = _altered(llama_dir, tmp_path / "bias", undeclared_bias)
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.down_proj.bias'"):
        load_model(tmp_path / "bias", config, torch.device("cpu"), torch.float32,
                   Shard.of(config, size, rank))


def test_a_pool_size_the_model_cannot_split_is_refused_naming_its_flag(llama_dir):
    """Before any worker starts (launch checks each pool's size against the model);
    adaptive workers take every role, so their two sizes must agree."""
    from pdserve.router.config import PoolSpec
    from pdserve.router.launch import launch
    with pytest.raises(ValueError, match="--decode-tensor-parallel-size: tensor_parallel_size "
                                         "3 does not divide its 8 attention heads"):
        launch(EngineConfig.from_kwargs(str(llama_dir)), PoolSpec(decode_tensor_parallel_size=3))
    with pytest.raises(ValueError, match="--tensor-parallel-size: tensor_parallel_size 16"):
        launch(EngineConfig.from_kwargs(str(llama_dir), tensor_parallel_size=16))
    with pytest.raises(ValueError, match="must be equal"):
        PoolSpec(mode="adaptive", prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1)
    assert PoolSpec(decode_tensor_parallel_size=2).tensor_parallel_size("both", 1) == 2
    assert PoolSpec(decode_tensor_parallel_size=2).tensor_parallel_size("prefill", 4) == 4


def test_a_step_goes_on_the_wire_with_only_the_blocks_its_sequences_reach():
    from pdserve.engine.step_buffers import StepInputs
    step = StepInputs(input_ids=[1, 2], positions=[4, 16], slots=[4, 16],
                      logits_indices=[0, 1], query_lens=[1, 1], seq_lens=[5, 17],
                      block_ids=[[7, 8, 9], [3, 4, 5, 6]], num_decodes=2,
                      num_decode_tokens=2)
    assert step.trimmed(4).block_ids == [[7, 8], [3, 4, 5, 6]]
    assert step.trimmed(16).block_ids == [[7], [3, 4]]
    assert step.block_ids == [[7, 8, 9], [3, 4, 5, 6]]  # the runner's own, untouched


def test_a_device_budget_below_the_pools_minima_is_refused_before_workers_start(llama_dir):
    from pdserve.router.config import AutoscaleSpec, PoolSpec, RouterConfig
    from pdserve.router.launch import launch
    with pytest.raises(ValueError, match="--max-devices 5: the pools' minima exceed"):
        launch(EngineConfig.from_kwargs(str(llama_dir)), PoolSpec(
            decode_tensor_parallel_size=8),
            router_config=RouterConfig(autoscale=AutoscaleSpec(autoscale=True, max_devices=5)))
    with pytest.raises(ValueError, match="--mode adaptive: every worker takes every role"):
        launch(EngineConfig.from_kwargs(str(llama_dir)), PoolSpec(
            mode="adaptive", decode_tensor_parallel_size=2))


def test_speculative_decoding_with_a_draft_on_rank_0_equals_hf(llama_dir, tmp_path):
    """The draft model runs whole on rank 0; the sharded target verifies its drafts
    (several tokens a sequence in one step) and the outputs equal HF's, as without."""
    from pdserve.engine.tiny_model import make_draft_model
    draft = make_draft_model(llama_dir, tmp_path / "one-layer", 1)
    oracle = Oracle(llama_dir)
    with tp_engine(llama_dir, 2, speculative_config={
            "method": "draft_model", "model": str(draft),
            "num_speculative_tokens": 3}) as engine:
        prompts = random_prompts(engine.model_config.vocab_size, seed=9)
        outputs = generate(engine, prompts)
        assert_matches_hf(SimpleNamespace(engine=engine), oracle, prompts, outputs)
        stats = engine.scheduler.stats  # drafts were verified, and some kept
        assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_swap_and_the_host_prefix_tier_copy_every_ranks_shard(llama_dir):
    """At TP 2 every rank copies its own KV heads between device and host: victims
    swapped out and back in, then every prompt again, its prefix loaded from the host
    tier, equal HF's."""
    from tests.engine.test_hf_oracle import host_gib
    oracle = Oracle(llama_dir)
    with threaded_engine(EngineConfig.from_kwargs(
            str(llama_dir), num_kv_blocks=20, tensor_parallel_size=2, preemption_mode="swap",
            swap_space=host_gib(llama_dir, 64), kv_offloading_size=host_gib(llama_dir, 128))) \
            as engine:
        prompts = random_prompts(engine.model_config.vocab_size, seed=3)
        first = generate(engine, prompts)
        assert engine.stats.num_swapped_out > 0
        again = generate(engine, prompts)  # (request ids reused: the first are done)
        assert engine.stats.host_prefix_cache_hits > 0
        scorer = SimpleNamespace(engine=engine)
        assert_matches_hf(scorer, oracle, prompts, first)
        assert_matches_hf(scorer, oracle, prompts, again)
        assert engine.block_manager.num_free_blocks == 20


def test_choices_copy_their_shared_block_on_every_rank(llama_dir):
    """n = 3 at TP 2, in a cache small enough to swap: each rank copies its own KV heads
    of a choice's shared, partly filled block (copy-on-write) and of the swapped
    blocks; every choice equals HF."""
    from tests.engine.test_hf_oracle import host_gib
    oracle = Oracle(llama_dir)
    with threaded_engine(EngineConfig.from_kwargs(
            str(llama_dir), num_kv_blocks=24, tensor_parallel_size=2, preemption_mode="swap",
            swap_space=host_gib(llama_dir, 64))) as engine:
        prompts = random_prompts(engine.model_config.vocab_size, seed=5)[:4]
        for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
            engine.add_request(str(i), prompt, replace(greedy(n), n=3))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.outputs.token_ids for o in engine.step() if o.finished})
        assert len(done) == 12
        for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
            expected = oracle.generate(prompt, n)[0]
            assert [done[choice_id(str(i), c)] for c in range(3)] == [expected] * 3
        assert engine.stats.num_swapped_out > 0
        assert engine.block_manager.num_free_blocks == 24
