"""The attention seam: the runner describes each step once, kernel-shaped, in
persistent buffers (StepMetadata); each backend builds its own plan from it; the
Triton backend runs the whole engine exactly (HF's greedy outputs) through chunked
prefill after earlier context, prefix hits, preemption, block sizes that are not the
kernel's key tile, and speculative verify rows with a draft model on the same backend.
Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve import LLM
from pdserve.engine.attention import resolve
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pdserve.engine.step_buffers import StepBuffers
from pdserve.engine.torch_attention import TorchAttention
from tests.engine.test_hf_oracle import MAX_TOKENS, Oracle, assert_matches_hf, run
from tests.engine.test_spec_decode import (  # noqa: F401
    assert_drafts,
    generate,
    greedy,
    prompts,
    proposers,
)

# The engine on the Triton backend: in the interpreter on CPU (tests/conftest.py sets it
# where there is no GPU), compiled on a GPU (scripts/gpu_check.sh), float32 on both.
DEVICE = {"device": "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" \
    else {"device": "cuda", "dtype": "float32"}

# a step: two decodes, a verification of 3 tokens, a prompt chunk of 5 after 6 computed
STEP = {"input_ids": list(range(10)), "positions": [2, 8, 4, 5, 6, 6, 7, 8, 9, 10],
        "slots": [30, 37, 20, 21, 22, 34, 35, 44, 45, 46],
        "logits_indices": [0, 1, 9, 2, 3, 4], "query_lens": [1, 1, 3, 5],
        "seq_lens": [3, 9, 7, 11], "block_ids": [[7], [2, 3, 9, 1], [4, 5], [6, 8, 10, 11, 0]],
        "num_decodes": 3, "num_decode_tokens": 5}


def test_the_step_is_described_once_kernel_shaped_in_buffers_that_persist():
    buffers = StepBuffers(torch.device("cpu"), block_size=4, max_tokens=4, max_seqs=2,
                          max_blocks=2)
    ids, positions, step, rows = buffers.fill(**STEP)
    assert ids.tolist() == STEP["input_ids"] and positions.tolist() == STEP["positions"]
    assert rows.tolist() == STEP["logits_indices"]
    assert step.query_start_loc.dtype == step.seq_lens.dtype == step.block_table.dtype \
        == torch.int32
    assert step.query_start_loc.tolist() == [0, 1, 2, 5, 10]
    assert step.seq_lens.tolist() == [3, 9, 7, 11]
    # each row its sequence's blocks for seq_len tokens, 0-padded to the widest
    assert step.block_table.tolist() == [[7, 0, 0], [2, 3, 9], [4, 5, 0], [6, 8, 10]]
    assert step.slot_mapping.tolist() == STEP["slots"]
    assert (step.max_query_len, step.max_seq_len, step.num_decodes, step.num_decode_tokens) \
        == (5, 11, 3, 5)
    # grown once to fit (powers of two), then reused: a smaller step allocates nothing
    assert (buffers.input_ids.rows, buffers.seq_lens.rows, buffers.block_table.width) \
        == (16, 4, 4)
    storage = buffers.input_ids.host.data_ptr(), buffers.block_table.host.data_ptr()
    ids, _, step, _ = buffers.fill([5], [2], [30], [0], [1], [3], [[7]], 1, 1)
    assert ids.data_ptr() == storage[0] and step.block_table.data_ptr() == storage[1]
    assert step.block_table.tolist() == [[7]] and step.query_start_loc.tolist() == [0, 1]


def test_the_torch_backend_builds_its_groups_and_segments_from_it():
    _, _, step, _ = StepBuffers(torch.device("cpu"), block_size=4).fill(**STEP)
    plan = TorchAttention(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4).build(step)
    decodes, verify = plan.decode_groups
    assert (decodes.start, decodes.end, decodes.query_len) == (0, 2, 1)
    assert decodes.block_table.tolist() == [[7, 0, 0], [2, 3, 9]]
    assert decodes.mask.shape == (2, 1, 1, 12) and decodes.mask.sum().item() == 3 + 9
    assert (verify.start, verify.end, verify.query_len) == (2, 5, 3)
    assert verify.mask.shape == (1, 1, 3 * 2, 8)  # 3 tokens x 2 query heads per KV head
    [chunk] = plan.prefills
    assert (chunk.start, chunk.num_tokens, chunk.context_len) == (5, 5, 11)
    assert chunk.block_ids.tolist() == [6, 8, 10, 11, 0]


def test_the_backend_is_chosen_by_device_and_refused_where_it_cannot_run(monkeypatch):
    assert resolve(None, torch.device("cpu")) == "torch"
    assert resolve("torch", torch.device("cpu")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend triton runs on cuda"):
        resolve("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return Oracle(llama_dir)


def test_the_triton_backend_equals_hf(llama_dir, oracle):
    # prompt chunks of 24 after earlier context in steps shared with decodes; blocks
    # of 5 (not the kernel's key tile), too few for every request: preemption, and
    # prefix hits when a preempted request comes back
    llm = LLM(str(llama_dir), attention_backend="triton", block_size=5, num_kv_blocks=64,
              long_prefill_token_threshold=24, max_num_batched_tokens=96, **DEVICE)
    assert llm.engine.runner.backend.name == "triton"
    batch = prompts(llm.engine.model_config.vocab_size, seed=4)
    assert_matches_hf(llm, oracle, batch, run(llm, batch))
    assert llm.engine.stats.num_preemptions > 0


def test_the_triton_backend_verifies_a_draft_model_s_tokens_exactly(llama_dir, oracle,
                                                                   proposers):  # noqa: F811
    llm = LLM(str(llama_dir), attention_backend="triton", kv_cache_memory_bytes=64 << 20,
              speculative_config=proposers["draft"], **DEVICE)
    batch = prompts(llm.engine.model_config.vocab_size, seed=5)
    assert_matches_hf(llm, oracle, batch, generate(llm, batch))
    assert_drafts(llm)
    assert len(batch) == len(MAX_TOKENS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_steps_padded_as_graphs_replay_them_are_exact(llama_dir, oracle, backend):
    """The padded static-buffer path CUDA graphs replay, run eagerly here: decode-only
    steps padded to a capture size (padding rows in the scratch block) equal HF."""
    llm = LLM(str(llama_dir), attention_backend=backend, kv_cache_memory_bytes=64 << 20,
              **DEVICE)
    runner = llm.engine.runner
    assert runner.scratch_block == llm.engine.block_manager.num_blocks  # handed to no one
    assert runner.kv_caches[0].shape[1] == runner.scratch_block + 1
    if runner.graphs is None:  # no CUDA: the same path, not captured
        runner.graphs = DecodeGraphs(capture_sizes(256), capture=False)
    padded = []
    replay = runner.graphs.run

    def counted(size, forward):
        padded.append(size)
        return replay(size, forward)
    runner.graphs.run = counted
    batch = prompts(llm.engine.model_config.vocab_size, seed=6)[:6 if backend == "triton" else 9]
    outputs = llm.generate(batch, [greedy(n) for n in MAX_TOKENS[:len(batch)]])
    assert_matches_hf(llm, oracle, batch, [o.token_ids for o in outputs])
    # decode steps of 1-9 sequences ran at sizes 1, 2, 4, 8, 16: padding rows in most
    assert set(padded) <= {1, 2, 4, 8, 16} and len(set(padded)) >= 2


def test_capture_sizes_are_vllm_s():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(0)[-1] == 512
    graphs = DecodeGraphs(capture_sizes(20), capture=False)
    assert [graphs.size_for(n) for n in (1, 3, 5, 17, 20, 21)] == [1, 4, 8, 20, 20, None]
