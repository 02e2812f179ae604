"""Greedy outputs equal HF transformers `generate` token for token in float32, under
every scheduling path. Where a sequence first differs, both logits vectors at that step
must agree within 1e-3 and the two chosen tokens must be a near-tie."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams

PROMPT_LENS = [5, 12, 31, 47, 64, 90, 128, 200, 17]
MAX_TOKENS = [24, 16, 32, 20, 24, 12, 28, 16, 24]
TOLERANCE = 1e-3
KV_BYTES = 64 << 20


def random_prompts(vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(4, vocab) for _ in range(n)] for n in PROMPT_LENS]


class Oracle:
    """HF greedy generations (batch of one, no padding), with per-step logits."""

    def __init__(self, model_dir):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}

    def generate(self, prompt: list[int], max_tokens: int):
        key = (tuple(prompt), max_tokens)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                    eos_token_id=None, pad_token_id=0, output_logits=True,
                    return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            assert len(tokens) == max_tokens
            self.cache[key] = (tokens, [step[0] for step in out.logits])
        return self.cache[key]


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_tied"])
def arch(request, model_dirs):
    return model_dirs[request.param], Oracle(model_dirs[request.param])


def assert_matches_hf(llm: LLM, oracle: Oracle, prompts, outputs: list[list[int]]) -> None:
    for prompt, max_tokens, got in zip(prompts, MAX_TOKENS, outputs):
        expected, hf_logits = oracle.generate(prompt, max_tokens)
        assert len(got) == max_tokens
        k = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if k is None:
            continue
        ours = llm.engine.score(prompt + got[:k]).cpu()
        diff = (ours - hf_logits[k]).abs().max().item()
        gap = abs(hf_logits[k][expected[k]] - hf_logits[k][got[k]]).item()
        assert diff <= TOLERANCE and gap <= 2 * TOLERANCE, (
            f"prompt of {len(prompt)} tokens diverges from HF at output {k}: "
            f"logits differ by {diff:.2e}, chosen tokens {gap:.2e} apart")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])]


def test_defaults(arch):
    model_dir, oracle = arch
    llm = LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=0)
    assert_matches_hf(llm, oracle, prompts, run(llm, prompts))


def test_chunked_prefill(arch):
    model_dir, oracle = arch
    llm = LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES, long_prefill_token_threshold=24,
              max_num_batched_tokens=96)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=1)
    chunked_steps = 0
    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        engine.add_request(f"c{i}", p, greedy(n))
    done = {}
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        chunked_steps += any(n > 1 and r.num_computed_tokens + n < r.num_tokens
                             for r, n in zip(out.requests, out.num_scheduled))
        assert max(out.num_scheduled, default=0) <= 24
        assert out.total_num_scheduled_tokens <= 96
        result = engine.runner.execute(out)
        for r in engine.scheduler.update(out, result):
            done[r.request_id] = r.output_token_ids
    assert chunked_steps > 0
    assert_matches_hf(llm, oracle, prompts, [done[f"c{i}"] for i in range(len(prompts))])


def test_prefix_caching(arch):
    model_dir, oracle = arch
    llm = LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=2, shared_prefix=40)
    first = run(llm, prompts)
    hits_before = llm.engine.stats.prefix_cache_hits
    second_outputs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    second = [o.token_ids for o in second_outputs]
    # Second pass: every prompt's full blocks (all but the last token) were cached.
    expected_hits = [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.num_cached_tokens for o in second_outputs] == expected_hits
    assert llm.engine.stats.prefix_cache_hits - hits_before == sum(expected_hits)
    assert_matches_hf(llm, oracle, prompts, first)
    assert_matches_hf(llm, oracle, prompts, second)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption(arch, prefix_caching):
    model_dir, oracle = arch
    # 20 blocks of 16 hold the largest request (200 + 16 tokens) but never all of them.
    # With prefix caching a resumed request may find its own freed blocks again.
    llm = LLM(str(model_dir), num_kv_blocks=20, enable_prefix_caching=prefix_caching)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=3)
    outputs = run(llm, prompts)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 20
    assert_matches_hf(llm, oracle, prompts, outputs)


def test_the_waiting_timeout_preempts_a_decode_and_every_output_stays_exact(arch):
    """Two requests decoding fill max_num_seqs; each later one carries a TTFT SLO it
    is already past (as the router passes them), so it is admitted in a decode's
    place; the decode recomputes later. Every output equals HF's."""
    model_dir, oracle = arch
    llm = LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES, max_num_seqs=2)
    engine = llm.engine
    prompts = random_prompts(engine.model_config.vocab_size, seed=4)[:5]
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        engine.add_request(str(i), prompt, greedy(n), arrival_time=0.0,
                           ttft_slo_s=None if i < 2 else 1e-3)
        if i == 1:
            engine.step()  # the first two are admitted (and decode) before the rest come
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs.token_ids for o in engine.step() if o.finished})
    assert engine.stats.num_preemptions_for_waiting >= 1
    assert_matches_hf(llm, oracle, prompts, [done[str(i)] for i in range(len(prompts))])


def host_gib(model_dir, num_blocks: int, block_size: int = 16) -> float:
    """GiB of host memory holding num_blocks of the model's KV (one rank, float32)."""
    from pdserve.engine.kv_cache import bytes_per_block
    from pdserve.engine.model_config import ModelConfig
    model = ModelConfig.from_dir(model_dir)
    return num_blocks * bytes_per_block(model, block_size, torch.float32) / (1 << 30)


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption(arch, mode):
    """test_preemption's pressure with a swap area: victims resume from host memory
    (under auto, those whose copy the engine's own fit prices below their recompute)
    and every output equals HF's; nothing is left in either tier after."""
    model_dir, oracle = arch
    llm = LLM(str(model_dir), num_kv_blocks=20, swap_space=host_gib(model_dir, 64),
              preemption_mode=mode)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=3)
    outputs = run(llm, prompts)
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.num_swapped_out > 0 or mode == "auto"
    assert llm.engine.block_manager.num_free_blocks == 20
    assert llm.engine.block_manager.host.num_used_blocks == 0
    assert_matches_hf(llm, oracle, prompts, outputs)


def test_swap_preemption_with_chunked_prefill_and_speculative_decoding(arch):
    """Victims swapped mid-prompt (chunks of 24) and mid-verification (n-gram drafts,
    on prompts that repeat themselves so drafts are accepted) resume exactly."""
    model_dir, oracle = arch
    llm = LLM(str(model_dir), num_kv_blocks=24, swap_space=host_gib(model_dir, 64),
              preemption_mode="swap", long_prefill_token_threshold=24,
              max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    prompts = [p[:12] * (len(p) // 12) + p[len(p) // 12 * 12:] if len(p) >= 24 else p
               for p in random_prompts(llm.engine.model_config.vocab_size, seed=6)]
    outputs = run(llm, prompts)
    stats = llm.engine.stats
    assert stats.num_swapped_out > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == 24
    assert_matches_hf(llm, oracle, prompts, outputs)


def test_host_prefix_tier(arch):
    """A device cache that keeps one prompt's blocks at a time: run again, each prompt
    finds its prefix in the host tier, loads it, counts it as cached (host part apart)
    and still equals HF."""
    model_dir, oracle = arch
    llm = LLM(str(model_dir), num_kv_blocks=16, kv_offloading_size=host_gib(model_dir, 128))
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=2)
    first = [llm.generate([p], [greedy(n)])[0] for p, n in zip(prompts, MAX_TOKENS)]
    second = [llm.generate([p], [greedy(n)])[0] for p, n in zip(prompts, MAX_TOKENS)]
    expected_hits = [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.num_cached_tokens for o in second] == expected_hits
    assert sum(o.num_host_cached_tokens for o in second) >= sum(expected_hits) // 2
    assert llm.engine.stats.host_prefix_cache_hits == sum(
        o.num_host_cached_tokens for o in first + second)
    assert_matches_hf(llm, oracle, prompts, [o.token_ids for o in first])
    assert_matches_hf(llm, oracle, prompts, [o.token_ids for o in second])
