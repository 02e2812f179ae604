"""Parallel sampling (SamplingParams.n > 1): one prefill, the prompt's blocks shared by
the n choices (reference counts, the last partly filled block copied when a choice
first writes into it), choice i drawing with seed + i. Exact against HF in float32,
and each seeded choice equal to a one-sequence request with its seed."""
from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import choice_id, parent_of
from pdserve.engine.sampling_params import StructuredOutputsParams

KV_BYTES = 64 << 20
BLOCK = 16


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(vocab: int, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 20, "temperature": 0, "ignore_eos": True, **kw})


def test_greedy_choices_are_equal_and_equal_hf(llm, hf):
    vocab = llm.engine.model_config.vocab_size
    prompts = [prompt_of(vocab, 37, 1), prompt_of(vocab, 32, 2)]  # a partial tail; none
    outs = llm.generate(prompts, [greedy(n=4, logprobs=True), greedy(n=3)])
    assert len(outs) == 7
    for prompt, choices in ((prompts[0], outs[:4]), (prompts[1], outs[4:])):
        expected = hf_greedy(hf, prompt, 20)
        assert [o.token_ids for o in choices] == [expected] * len(choices)
        assert [o.text for o in choices] == [choices[0].text] * len(choices)
    assert all(o.logprobs == outs[0].logprobs and len(o.logprobs) == 20 for o in outs[:4])
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every choice freed its own and the shared


def test_the_prompt_is_computed_once_and_its_blocks_shared(llama_dir):
    engine = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK).engine
    vocab, bm = engine.model_config.vocab_size, engine.block_manager
    prompt = prompt_of(vocab, 37, 3)  # two full blocks and a partly filled one
    engine.add_request("r", prompt, greedy(n=4))
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(choice_id("r", i) for i in range(4))
    running = engine.scheduler.running
    assert len(running) == 4 and len({tuple(r.block_ids) for r in running}) == 1
    shared = list(running[0].block_ids)
    assert [bm.blocks[b].ref_cnt for b in shared] == [4, 4, 4]
    assert bm.num_free_blocks == bm.num_blocks - 3  # one prefill's blocks, no more
    engine.step()  # each writes its second token: the tail is copied first, 3 times
    tails = {r.block_ids[2] for r in running}
    assert len(tails) == 4 and shared[2] in tails
    assert [r.block_ids[:2] for r in running] == [shared[:2]] * 4
    assert [bm.blocks[b].ref_cnt for b in shared[:2]] == [4, 4]
    assert all(bm.blocks[t].ref_cnt == 1 for t in tails)
    assert bm.num_free_blocks == bm.num_blocks - 6
    while engine.has_unfinished():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_seeded_choice_equals_one_sequence_with_seed_plus_index(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = prompt_of(vocab, 21, 4)
    sampled = dict(max_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True, logprobs=True)
    outs = llm.generate([prompt], SamplingParams(n=3, seed=1234, **sampled))
    again = llm.generate([prompt], SamplingParams(n=3, seed=1234, **sampled))
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=1234 + i, **sampled)
                                        for i in range(3)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    for o, a in zip(outs, alone):
        assert o.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert len({tuple(o.token_ids) for o in outs}) == 3  # three draws, not one
    unseeded = llm.generate([prompt], SamplingParams(n=4, max_tokens=16, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_choices_preempted_and_recomputed_stay_exact(llama_dir, hf):
    """A cache too small for the choices to grow: they preempt each other (their
    shared blocks freed a reference at a time) and recompute; still HF's output."""
    small = LLM(str(llama_dir), num_kv_blocks=14, block_size=4, max_num_seqs=8)
    vocab = small.engine.model_config.vocab_size
    prompt = prompt_of(vocab, 10, 5)
    outs = small.generate([prompt], greedy(n=5, max_tokens=24))
    assert small.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, prompt, 24)] * 5
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_choices_with_speculative_decoding_equal_hf(llama_dir, hf, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        spec["model"] = str(llama_dir)
    engine = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK,
                 speculative_config=spec)
    vocab = engine.engine.model_config.vocab_size
    base = prompt_of(vocab, 9, 6)
    prompt = base * 3 + base[:4]  # repeats: n-gram drafts are proposed
    outs = engine.generate([prompt], greedy(n=3, max_tokens=24))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, prompt, 24)] * 3
    assert engine.engine.stats.spec_decode_num_drafts > 0


def test_structured_choices_each_hold_the_schema(llm):
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate([prompt_of(vocab, 13, 7)], params)
    for o in outs:
        assert o.finish_reason == "stop"
        assert set(json.loads(o.text)) == {"n"}


def test_a_choice_may_stop_at_its_first_token(llm):
    """max_tokens 1: every choice ends with the token it was forked with."""
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate([prompt_of(vocab, 19, 8)], SamplingParams(n=6, max_tokens=1, seed=3))
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert {o.finish_reason for o in outs} == {"length"}
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_n_names_the_field(llm):
    for bad in (0, -1, 129, 2.5, True):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(n=bad)
        assert err.value.field == "n"
    few = LLM(llm.engine.config.model, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as err:
        few.generate([[5, 6, 7]], SamplingParams(n=5))
    assert err.value.field == "n" and "max_num_seqs" in str(err.value)
    assert not few.engine.has_unfinished()


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}])
def test_a_prompt_whose_last_chunk_is_one_token_still_forks(llama_dir, hf, spec):
    """Chunked prefill can leave one prompt token for a step of its own, which looks
    like a decode (the steady batch, a draft to verify): the first token is still
    drawn for every choice there."""
    engine = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK,
                 long_prefill_token_threshold=16, speculative_config=spec)
    vocab = engine.engine.model_config.vocab_size
    base = prompt_of(vocab, 8, 9)
    for prompt in ((base * 3)[:17], (base * 5)[:33]):  # alone: nothing else in its steps
        choices = engine.generate([prompt], greedy(n=3, max_tokens=12))
        assert [o.token_ids for o in choices] == [hf_greedy(hf, prompt, 12)] * 3
        assert [parent_of(o.request_id) is not None for o in choices] == [False, True, True]


def test_a_row_that_fails_to_sample_moves_no_other_rows_draws(llm, monkeypatch):
    """A request whose sampling fails alone ends alone; a request for n > 1 beside it
    keeps its draws in their places: each seeded choice still equals seed + i."""
    from tests.faults import FaultySampler
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = prompt_of(vocab, 11, 10)
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate([prompt] * 2, [SamplingParams(seed=50 + i, **sampled)
                                                               for i in range(2)])]
    monkeypatch.setattr(engine.runner, "sampler", FaultySampler(
        engine.runner.sampler, lambda r: r.request_id == "poison"))
    engine.add_request("poison", prompt_of(vocab, 7, 11), greedy())
    engine.add_request("n2", prompt, SamplingParams(n=2, seed=50, **sampled))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done.pop("poison").finish_reason == "error"
    assert [done["n2"].token_ids, done[choice_id("n2", 1)].token_ids] == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_num_seqs_counts_every_choice(llama_dir, hf):
    engine = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4).engine
    vocab = engine.model_config.vocab_size
    prompts = [prompt_of(vocab, 9 + i, 20 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(n=2, max_tokens=8))
    done, most = {}, 0
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        most = max(most, len(engine.scheduler.running))
    assert most == 4  # two requests' two choices at once, never the third's too
    for i, prompt in enumerate(prompts):
        assert [done[choice_id(str(i), c)] for c in range(2)] == [hf_greedy(hf, prompt, 8)] * 2


class _FailingChoiceRow:
    """The engine's sampler, except that a batch holding a row drawn under `seed`
    raises (so the rows are sampled one by one, and that row fails alone)."""

    def __init__(self, real, seed: int):
        self.real, self.seed = real, seed

    def sample(self, logits, requests, params=None):
        if any(p.seed == self.seed for p in params or [r.sampling_params for r in requests]):
            raise RuntimeError("injected fault")
        return self.real.sample(logits, requests, params)

    def forget(self, request_id):
        self.real.forget(request_id)


def test_a_choice_row_that_fails_fails_its_request_alone(llm, monkeypatch):
    """Choice 1's row fails, choice 0's samples: the request ends with an error, no
    choice forks, and the engine goes on (the step reported its token and its failure
    at once, and crashed)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    monkeypatch.setattr(engine.runner, "sampler",
                        _FailingChoiceRow(engine.runner.sampler, seed=61))
    engine.add_request("n2", prompt_of(vocab, 9, 12),
                       SamplingParams(n=2, seed=60, max_tokens=4, ignore_eos=True))
    engine.add_request("other", prompt_of(vocab, 6, 13), greedy(max_tokens=4))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"n2", "other"}
    assert done["n2"].finish_reason == "error" and "injected fault" in done["n2"].error
    assert done["other"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prefill_worker_takes_one_seat_a_request(llama_dir):
    """A prefill worker only draws the choices' first tokens (forks_here False): a
    request for n takes one of its max_num_seqs seats, not n."""
    engine = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4).engine
    vocab = engine.model_config.vocab_size
    for i in range(4):
        engine.add_request(str(i), prompt_of(vocab, 10, 30 + i),
                           SamplingParams(n=4, max_tokens=1, seed=i), forks_here=False)
    outs = engine.step()  # all four prefilled in one step
    assert sorted(o.request_id for o in outs) == ["0", "1", "2", "3"]
    assert all(o.finished and len(o.choices) == 3 for o in outs)
    assert not engine.has_unfinished()
