"""Speculative decoding offline: greedy outputs equal HF transformers' (float32) with
each proposer, through chunked prefill, prefix caching and preemption; stops and
max_tokens inside an accepted run; logprobs of accepted tokens; seeded sampling drawn
as plain decoding draws it; KV blocks and prefix-cache hashes exact after rejections."""
from __future__ import annotations

import json
import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.block_manager import hash_block
from pdserve.engine.tiny_model import make_draft_model
from tests.engine.test_hf_oracle import MAX_TOKENS, PROMPT_LENS, Oracle, assert_matches_hf

KV_BYTES = 64 << 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return Oracle(llama_dir)


@pytest.fixture(scope="module")
def proposers(llama_dir, tmp_path_factory):
    """Each proposer: prompt lookup; a draft of the target's first layer (it guesses
    right sometimes: acceptances and rejections); the target itself as its own draft
    (every draft accepted: long runs)."""
    draft = make_draft_model(llama_dir, tmp_path_factory.mktemp("draft") / "one-layer", 1)
    return {"ngram": NGRAM,
            "draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
            "self": {"method": "draft_model", "model": str(llama_dir),
                     "num_speculative_tokens": 4}}


def prompts(vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """As the oracle test's, every other one a phrase repeated (prompt lookup finds
    it): requests with and without proposals share steps."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(shared_prefix)]
    out = []
    for i, n in enumerate(PROMPT_LENS):
        phrase = [rng.randrange(4, vocab) for _ in range(max(n // 3, 2) if i % 2 else n)]
        out.append(prefix + (phrase * 3)[:n])
    return out


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def generate(llm: LLM, batch, **kw) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(batch, [greedy(n, **kw) for n in MAX_TOKENS])]


def spec_llm(llama_dir, spec, **kw) -> LLM:
    return LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, speculative_config=spec, **kw)


def assert_drafts(llm: LLM, rejected: bool = True) -> None:
    s = llm.engine.stats
    assert s.spec_decode_num_accepted_tokens > 0
    if rejected:
        assert s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens


@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_greedy_equals_hf_with_each_proposer(llama_dir, oracle, proposers, name):
    llm = spec_llm(llama_dir, proposers[name])
    batch = prompts(llm.engine.model_config.vocab_size, seed=0)
    assert_matches_hf(llm, oracle, batch, generate(llm, batch))
    assert_drafts(llm, rejected=name != "self")
    if name == "self":  # all k drafts accepted: about k + 1 tokens a step
        assert llm.engine.num_steps < max(MAX_TOKENS) / 3
    # What each step reports (the latency model's input) accounts for verification.
    stats, timings = llm.engine.stats, llm.engine.step_timings
    assert sum(t.shape.draft_tokens for t in timings) == stats.spec_decode_num_draft_tokens
    assert sum(t.decode_tokens - t.shape.decode_seqs for t in timings) == \
        stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_chunked_prefill_and_prefix_caching(llama_dir, oracle, proposers, name):
    llm = spec_llm(llama_dir, proposers[name], long_prefill_token_threshold=24,
                   max_num_batched_tokens=96)
    batch = prompts(llm.engine.model_config.vocab_size, seed=1, shared_prefix=40)
    first = generate(llm, batch)
    second = llm.generate(batch, [greedy(n) for n in MAX_TOKENS])
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in batch]
    assert_matches_hf(llm, oracle, batch, first)
    assert_matches_hf(llm, oracle, batch, [o.token_ids for o in second])
    assert_drafts(llm)


@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_preemption(llama_dir, oracle, proposers, name):
    # 20 blocks of 16 hold the largest request but never all of them at once.
    llm = LLM(str(llama_dir), num_kv_blocks=20, speculative_config=proposers[name])
    batch = prompts(llm.engine.model_config.vocab_size, seed=3)
    outputs = generate(llm, batch)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 20
    assert_matches_hf(llm, oracle, batch, outputs)
    assert_drafts(llm, rejected=name != "self")


def test_stops_and_max_tokens_inside_an_accepted_run(llama_dir, proposers):
    """With every draft accepted, a step emits up to 5 tokens: a stop token, a stop
    string or max_tokens falling inside such a run ends the output exactly where
    decoding one token a step ends it (same tokens, text, reasons)."""
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES)
    spec = spec_llm(llama_dir, proposers["self"])
    batch = prompts(plain.engine.model_config.vocab_size, seed=4)[:4]
    free = plain.generate(batch, greedy(24))
    cases = []
    for prompt, out in zip(batch, free):
        token = out.token_ids[7]  # the stop falls in the second run (tokens 6..10)
        text = plain.tokenizer.decode(out.token_ids[6:8])
        cases += [(prompt, greedy(24, stop_token_ids=[token])),
                  (prompt, greedy(24, stop=[text.strip() or text])),
                  (prompt, greedy(8)),
                  (prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                          stop_token_ids=[token], logprobs=True))]
    expected = plain.generate([p for p, _ in cases], [s for _, s in cases])
    got = spec.generate([p for p, _ in cases], [s for _, s in cases])
    for e, g in zip(expected, got):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (e.token_ids, e.text, e.finish_reason, e.stop_reason)
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    assert any(len(e.token_ids) < 24 for e in expected)  # stops did end outputs early
    assert spec.engine.stats.spec_decode_num_accepted_tokens > 0


def test_logprobs_of_accepted_tokens(llama_dir, proposers):
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES)
    spec = spec_llm(llama_dir, proposers["ngram"])
    batch = prompts(plain.engine.model_config.vocab_size, seed=5)
    params = [greedy(n, logprobs=True, top_logprobs=3) for n in MAX_TOKENS]
    for e, g in zip(plain.generate(batch, params), spec.generate(batch, params)):
        assert g.token_ids == e.token_ids and len(g.logprobs) == len(g.token_ids)
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert [list(t) for t in g.top_logprobs] == [list(t) for t in e.top_logprobs]
    assert_drafts(spec)


@pytest.mark.parametrize("name", ["ngram", "self"])
def test_seeded_sampling_draws_what_plain_decoding_draws(llama_dir, proposers, name):
    """A seeded request's k-th token is drawn from (seed, k) whether a verification
    step or a plain one samples it, also with penalties and after preemption: the
    same tokens with and without speculation."""
    batch = prompts(4096, seed=6)
    batch = [[t % 2000 + 4 for t in p] for p in batch]
    params = [SamplingParams(max_tokens=n, temperature=0.5, top_p=0.9, top_k=5, seed=i,
                             ignore_eos=True, repetition_penalty=1.1 if i % 3 == 0 else 1.0)
              for i, n in enumerate(MAX_TOKENS)]
    expected = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES).generate(batch, params)
    spec = LLM(str(llama_dir), num_kv_blocks=20, speculative_config=proposers[name])
    got = spec.generate(batch, params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert spec.engine.stats.num_preemptions > 0
    assert spec.engine.stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_kv_blocks_and_prefix_hashes_after_rejections(llama_dir, oracle, proposers, name):
    """Rejected drafts leave nothing behind: every block returns to the pool, every
    cached block holds the tokens its chained hash names (tokens the requests really
    produced), and a prompt continuing an earlier output hits those blocks and
    decodes as HF does."""
    llm = spec_llm(llama_dir, proposers[name])
    engine = llm.engine
    batch = prompts(engine.model_config.vocab_size, seed=7)
    outputs = generate(llm, batch)
    assert_drafts(llm)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    real = set()
    for prompt, output in zip(batch, outputs):
        tokens, parent = prompt + output, b""
        for i in range(len(tokens) // bm.block_size):
            parent = hash_block(parent, tokens[i * bm.block_size:(i + 1) * bm.block_size])
            real.add(parent)
    assert bm._cached and set(bm._cached) <= real
    for block_hash, block_id in bm._cached.items():
        assert bm.blocks[block_id].block_hash == block_hash
    longest = max(range(len(batch)), key=lambda i: len(batch[i]) + len(outputs[i]))
    follow = batch[longest] + outputs[longest]
    again = llm.generate([follow], greedy(16))[0]
    assert again.num_cached_tokens == (len(follow) - 1) // bm.block_size * bm.block_size
    expected, _ = oracle.generate(follow, 16)
    assert again.token_ids == expected


def test_the_config_is_validated_where_built_and_reaches_the_cli(llama_dir, tmp_path):
    from pdserve import cli_flags
    from pdserve.cli import build_parser
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.spec_decode.config import SpeculativeConfig
    from pdserve.engine.tiny_model import TinySpec, make_tiny_model, train_tokenizer
    for bad, field in [({"method": "eagle"}, "method"),
                       ({"method": "draft_model"}, "model"),
                       ({"method": "ngram", "model": "x"}, "model"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                       ({"k": 4}, "unknown")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(str(llama_dir), speculative_config=bad)
    args = build_parser().parse_args(
        ["serve", "--speculative-config", json.dumps(NGRAM)])
    assert cli_flags.engine_config(args, "tiny").speculative_config == SpeculativeConfig(**NGRAM)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "x"}'])
    # A draft model must share the target's vocabulary.
    other = make_tiny_model(tmp_path / "other", TinySpec(hidden_size=64, intermediate_size=128,
                                                         num_layers=1, num_heads=2,
                                                         num_kv_heads=1, vocab_size=600),
                            tokenizer=train_tokenizer(600))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
