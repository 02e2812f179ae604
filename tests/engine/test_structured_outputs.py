"""Structured outputs, logit_bias and min_tokens in the engine, against HF transformers
with the same weights: greedy output under a constraint equals HF generate with
xgrammar's own HF logits processor, token for token in float32, for every kind of
constraint, in a batch beside unconstrained requests, under speculative decoding
(drafts the grammar refuses are rejected), for a request moved mid-stream (its
grammar state rebuilt from its outputs) and under preemption."""
from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from pdserve import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.structured_outputs import choice_grammar

KV_BYTES = 64 << 20
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["ok", "color", "n"],
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"),
    "choice": StructuredOutputsParams(choice=("alpha", "beta", 'say "gamma"')),
    "grammar": StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe " ("so" | "not")'),
}
MAX_TOKENS = 40


class XgrammarOracle:
    """HF greedy generation with xgrammar's HF logits processor (its matcher, its
    mask), the tokenizer read the way xgrammar reads an HF fast tokenizer."""

    def __init__(self, model_dir, eos: list[int]):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.model.config.vocab_size,
                                                  stop_token_ids=eos)
        self.compiler, self.eos = xgr.GrammarCompiler(info), eos

    def compile(self, c: StructuredOutputsParams):
        if c.json is not None:
            return self.compiler.compile_json_schema(c.json, any_whitespace=False)
        if c.json_object:
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.regex is not None:
            return self.compiler.compile_regex(c.regex)
        return self.compiler.compile_grammar(c.grammar or choice_grammar(c.choice))

    def generate(self, prompt: list[int], max_tokens: int, constraint=None, **kw) -> list[int]:
        processors = [xgr.contrib.hf.LogitsProcessor(self.compile(constraint))] \
            if constraint is not None else []
        kw = {"eos_token_id": self.eos, **kw}  # eos_token_id=None: generate past eos
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, logits_processor=processors,
                pad_token_id=self.eos[0], **kw)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def oracle(llama_dir, llm):
    return XgrammarOracle(llama_dir, list(llm.engine.eos_token_ids))


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def constrained(c: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0,
                             "structured_outputs": c, **kw})


def valid(c: StructuredOutputsParams, text: str) -> bool:
    if c.choice is not None:
        return text in c.choice
    if c.json_object:
        return isinstance(json.loads(text), dict)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
        xgr.Grammar.from_json_schema(c.json, any_whitespace=False) if c.json
        else xgr.Grammar.from_regex(c.regex) if c.regex
        else xgr.Grammar.from_ebnf(c.grammar) if c.grammar
        else xgr.Grammar.builtin_json_grammar()))
    return matcher.accept_string(text) and matcher.is_completed()


def test_each_kind_equals_hf_with_xgrammar_in_one_batch_beside_free_requests(llm, oracle):
    """Every constraint, two prompts each, in one batch with unconstrained greedy
    requests: each output equals HF's under the same grammar; a finished one is valid
    (and the JSON schema's parses and validates); the free rows are as HF's plain
    greedy (the mask touched only its own rows)."""
    vocab = llm.engine.model_config.vocab_size
    ps = prompts(vocab, 2 * len(CONSTRAINTS) + 2)
    params = [constrained(c) for c in CONSTRAINTS.values() for _ in range(2)]
    params += [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    outs = llm.generate(ps, params)
    finished = 0
    for prompt, p, out in zip(ps, params, outs):
        c = p.structured_outputs
        expected = oracle.generate(prompt, p.max_tokens, c) if c else \
            oracle.generate(prompt, p.max_tokens, eos_token_id=None)
        assert out.token_ids == expected
        if c is not None and out.finish_reason == "stop":
            finished += 1
            assert valid(c, out.text), (c.kind, out.text)
            if c.json:
                doc = json.loads(out.text)
                assert set(doc) == {"ok", "color", "n"} and doc["color"] in ("red", "green", "blue")
    assert finished >= 8  # all but a free-form JSON object end within max_tokens


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_speculative_drafts_are_checked_against_the_grammar(llama_dir, llm, oracle, method):
    """A proposer that ignores the grammar (the target drafting for itself proposes
    its unconstrained argmax; prompt lookup repeats the prompt): drafts the grammar
    refuses are rejected, accepted ones advance the state, and the outputs equal HF's
    constrained greedy."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3} if method == "ngram" else
            {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3})
    spec_llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, speculative_config=spec)
    vocab = llm.engine.model_config.vocab_size
    ps = prompts(vocab, 6, seed=1)
    if method == "ngram":  # the schema's own text in the prompt: lookups propose it
        ps = [p + llm.engine.tokenizer.encode('{"ok": true, "color": "red", "n": 1}',
                                              add_special_tokens=False) * 2 for p in ps]
    c = CONSTRAINTS["json"]
    outs = spec_llm.generate(ps, [constrained(c)] * len(ps))
    for prompt, out in zip(ps, outs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS, c)
    stats = spec_llm.engine.stats
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if method == "ngram":  # prompt lookup proposes the schema's own text: some pass
        assert stats.spec_decode_num_accepted_tokens > 0


def test_a_moved_request_rebuilds_its_state_from_its_outputs(llm):
    """As a replayed or live-migrated request arrives: its prompt and the outputs it
    made elsewhere; it goes on exactly as the request that never moved."""
    vocab = llm.engine.model_config.vocab_size
    prompt = prompts(vocab, 1, seed=2)[0]
    c = CONSTRAINTS["json"]
    whole = llm.generate([prompt], [constrained(c)])[0].token_ids
    engine = llm.engine
    for k in (1, 5, len(whole) // 2):
        engine.add_request(f"moved-{k}", prompt, constrained(c), output_token_ids=whole[:k])
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
        assert outs[f"moved-{k}"].token_ids == whole


def test_preempted_structured_requests_recompute_and_stay_exact(llama_dir, oracle):
    """A cache too small for the batch: requests are preempted and recomputed mid
    constraint; their outputs still equal HF's."""
    small = LLM(str(llama_dir), num_kv_blocks=12, block_size=4, max_num_seqs=6)
    ps = prompts(small.engine.model_config.vocab_size, 6, seed=3)
    ps = [p[:8] for p in ps]
    c = CONSTRAINTS["json"]
    outs = small.generate(ps, [constrained(c)] * len(ps))
    assert small.engine.stats.num_preemptions > 0
    for prompt, out in zip(ps, outs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS, c)


def test_logit_bias_and_min_tokens_equal_hf(llm, oracle):
    """logit_bias as HF's sequence_bias on single tokens; min_tokens as HF's
    min_new_tokens: eos pushed up by +100 comes right after min_tokens, never before."""
    vocab = llm.engine.model_config.vocab_size
    eos = oracle.eos[0]
    ps = prompts(vocab, 3, seed=4)
    free = [oracle.generate(p, 8, eos_token_id=None) for p in ps]
    # The free run's 2nd token pushed down, another token up a little.
    biases = [{f[1]: -100.0, (f[1] + 7) % vocab: 2.5} for f in free]
    outs = llm.generate(ps, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                            logit_bias=b) for b in biases])
    for p, b, out in zip(ps, biases, outs):
        hf = oracle.generate(p, 8, eos_token_id=None,
                             sequence_bias={(t,): v for t, v in b.items()})
        assert out.token_ids == hf and out.token_ids[1] != free[ps.index(p)][1]
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=5, logit_bias={eos: 100.0})
    for p, out in zip(ps, llm.generate(ps, [params] * len(ps))):
        assert out.token_ids == oracle.generate(p, 12, min_new_tokens=5,
                                                sequence_bias={(eos,): 100.0})
        assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
        assert out.finish_reason == "stop"


def test_a_constraint_outranks_min_tokens_and_logprobs_stay_finite(llm):
    """min_tokens past a grammar's end: once the grammar is complete only eos is
    left, so eos it is (never a token outside the grammar); several such requests in
    one step fail nothing. Logprobs under a mask are finite (vLLM's -9999 floor for
    a masked token), so JSON can carry them."""
    vocab = llm.engine.model_config.vocab_size
    ps = prompts(vocab, 3, seed=7)
    c = CONSTRAINTS["choice"]
    outs = llm.generate(ps, [constrained(c, min_tokens=6, top_logprobs=5)] * len(ps))
    for out in outs:
        assert out.finish_reason == "stop" and out.text in c.choice
        assert out.token_ids[-1] in llm.engine.eos_token_ids
        values = out.logprobs + [v for top in out.top_logprobs for v in top.values()]
        assert all(-9999.0 <= v <= 0 for v in values)
        assert any(v == -9999.0 for top in out.top_logprobs for v in top.values())


def test_a_penalty_rounding_to_zero_keeps_masked_tokens_out(llm):
    """Schemathesis found it: repetition_penalty 5e-324 is 0 in float32, and -inf x 0
    made a masked prompt token's logit NaN, which greedy argmax took (a 500)."""
    vocab = llm.engine.model_config.vocab_size
    c = StructuredOutputsParams(json="{}")  # any JSON value
    outs = llm.generate(prompts(vocab, 2, seed=8), [constrained(
        c, max_tokens=12, repetition_penalty=5e-324)] * 2)
    for out in outs:
        assert out.finish_reason in ("stop", "length") and out.error is None


def test_min_tokens_holds_back_stop_strings_too(llm):
    """vLLM's rule: a stop string is looked for once more than min_tokens are out."""
    vocab = llm.engine.model_config.vocab_size
    prompt = prompts(vocab, 1, seed=5)[0]
    free = llm.generate([prompt], [SamplingParams(max_tokens=10, temperature=0,
                                                  ignore_eos=True)])[0]
    stop = free.text[:3]
    assert stop
    early = llm.generate([prompt], [SamplingParams(max_tokens=10, temperature=0,
                                                   ignore_eos=True, stop=[stop])])[0]
    assert early.finish_reason == "stop" and early.text == ""
    held = llm.generate([prompt], [SamplingParams(max_tokens=10, temperature=0,
                                                  ignore_eos=True, stop=[stop],
                                                  min_tokens=4)])[0]
    assert len(held.token_ids) > 4 or held.finish_reason == "length"


def test_bad_input_names_the_field_and_changes_nothing(llm):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    free = engine.block_manager.num_free_blocks
    cases = [
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        (SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "nope"}')),
         "structured_outputs"),
        (SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")),
         "structured_outputs"),
    ]
    for params, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", [5, 6, 7], params)
        assert err.value.field == field
    for kwargs, field in [({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
                          ({"logit_bias": {3: 101}}, "logit_bias"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"logit_bias": {3: float("nan")}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**kwargs)
        assert err.value.field == field
    for kwargs in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": ""}):
        with pytest.raises(InvalidRequestError) as err:
            StructuredOutputsParams(**kwargs)
        assert err.value.field == "structured_outputs"
    assert engine.block_manager.num_free_blocks == free and not engine.has_unfinished()


def test_prompt_logprobs_equal_hf_log_softmax(llama_dir, oracle):
    """Each prompt token's logprob (and rank, and the top ones) as HF's log-softmax of
    its logits over the prompt, in fp32: in prompt chunks (a long prompt split by the
    token budget), a two-token prompt, beside a plain request, and with the
    prompt's prefix cached already (a request asking for them computes it whole)."""
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=64,
              block_size=8)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(6)
    ps = [[rng.randrange(4, vocab) for _ in range(n)] for n in (150, 2, 33)]
    llm.generate([ps[0]], [SamplingParams(max_tokens=1)])  # its prefix now cached
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k) for k in (3, 0, 5)]
    outs = llm.generate(ps + [ps[2]], params + [SamplingParams(max_tokens=2, temperature=0)])
    assert outs[3].prompt_logprobs is None
    for prompt, p, out in zip(ps, params, outs):
        with torch.no_grad():
            hf = torch.log_softmax(oracle.model(torch.tensor([prompt])).logits[0], dim=-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            logprob, rank, top = got[pos]
            row = hf[pos - 1]
            assert logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-3)
            assert abs(rank - (int((row > row[prompt[pos]]).sum()) + 1)) <= 1  # ties aside
            assert len(top) == p.prompt_logprobs
            for token, value in top.items():
                assert value == pytest.approx(row[token].item(), abs=1e-3)
        assert out.num_cached_tokens == 0
