import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, race_noise, unit


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20)


PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 80))]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    second = [o.token_ids for o in llm.generate(PROMPTS, params)]
    other = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=99))]
    assert first == second
    assert first != other


def test_a_seeded_token_depends_only_on_seed_and_index():
    # What lets a prefill worker sample token 0 and a decode worker the rest.
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))

    def at(k: int, seed: int = 7) -> Request:  # a request with k output tokens
        return Request("r", [1], SamplingParams(temperature=1.0, seed=seed), 0.0,
                       output_token_ids=[2] * k)

    one = Sampler(seed=0)
    run = [one.sample(logits, [at(k)])[0][0] for k in range(12)]
    fresh = [Sampler(seed=k).sample(logits, [at(k)])[0][0] for k in range(12)]
    assert run == fresh
    assert len(set(run)) > 1  # the index changes the draw
    other = [Sampler(seed=0).sample(logits, [at(k, seed=8)])[0][0] for k in range(12)]
    assert other != run


def test_seeded_sampling_ignores_batch_companions(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], params)[0].token_ids
    batched = llm.generate([[9, 8, 7], PROMPTS[1], list(range(100, 160))], params)[1].token_ids
    assert alone == batched


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, top_k=1,
                                                 ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_stop_string_is_trimmed(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))[0]
    stop = full.text[6:9]
    assert len(stop) == 3 and stop not in full.text[:6]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                                  ignore_eos=True))[0]
    assert out.text == full.text[:full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 24


def test_stop_token_and_max_tokens(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_id = full.token_ids[5]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0,
                                                  stop_token_ids=[stop_id]))[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0,
                                                   ignore_eos=True))[0]
    eos = full.token_ids[3]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (eos,)  # pretend this token is the model's eos
    try:
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))[0]
        ignored = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0,
                                                          ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    assert ignored.token_ids == full.token_ids


def test_logprobs_of_chosen_tokens(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logprobs=True,
                                                  ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    logits = llm.engine.score(PROMPTS[0])
    expected = logits.log_softmax(-1)[out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-5)
    assert all(lp <= 0 for lp in out.logprobs)


def test_earliest_of_several_stop_strings_wins(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))[0]
    early, late = full.text[4:7], full.text[12:15]
    assert early not in full.text[:4] and late not in full.text[:12]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                  stop=[late, early], ignore_eos=True))[0]
    assert out.text == full.text[:4] and out.stop_reason == early


def _stream(llm, prompt, params) -> list[str]:
    """The new_text of every step of one request, through the engine's step loop."""
    engine = llm.engine
    engine.add_request("stream", prompt, params)
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert final.finished and "".join(deltas) == final.text
    return deltas


def test_streamed_text_never_shows_part_of_a_stop_string(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    deltas = _stream(llm, PROMPTS[1], greedy)
    full = "".join(deltas)
    # A stop string that starts in one step's text and ends in a later step's.
    ends = [len("".join(deltas[:i + 1])) for i in range(len(deltas))]
    boundary = next(e for e in ends[2:] if full[e - 1:e + 2] not in full[:e - 1] and e + 2 <= len(full))
    stop = full[boundary - 1:boundary + 2]
    deltas = _stream(llm, PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True, stop=[stop]))
    final = full[:full.index(stop)]
    assert "".join(deltas) == final
    for i in range(len(deltas)):  # every streamed prefix is a prefix of the final text
        assert final.startswith("".join(deltas[:i + 1]))
    # Without a stop string nothing is held back; with one, the held tail comes at the end.
    held = _stream(llm, PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True, stop=["\x00\x01\x02"]))
    assert "".join(held) == full and held[-1].endswith(full[-2:])


def test_repetition_penalty_matches_hf(llm, llama_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 100, 101]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    got = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                              repetition_penalty=1.5))[0].token_ids
    plain = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0,
                                                ignore_eos=True))[0].token_ids
    assert got == expected[0, len(prompt):].tolist()
    assert got != plain


def test_frequency_and_presence_penalties_follow_the_output_counts(llm):
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            frequency_penalty=1.5, presence_penalty=0.5, logprobs=True)
    out = llm.generate(prompt, params)[0]
    for k, token in enumerate(out.token_ids):
        logits = llm.engine.score(prompt + out.token_ids[:k]).clone()
        raw = logits.log_softmax(-1)[token].item()
        for t in set(out.token_ids[:k]):
            logits[t] -= 1.5 * out.token_ids[:k].count(t) + 0.5
        assert token == int(logits.argmax())
        assert out.logprobs[k] == pytest.approx(raw, abs=1e-5)  # of the raw logits
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0,
                                                ignore_eos=True))[0].token_ids
    assert len(set(out.token_ids)) > len(set(plain))


def test_min_p_1_keeps_only_the_top_token(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    top = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0,
                                               ignore_eos=True))
    assert [o.token_ids for o in top] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("min_p", 1.5),
                                          ("top_logprobs", 21)])
def test_penalty_ranges_are_checked(field, value):
    from pdserve.engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_top_logprobs_are_the_most_likely_tokens(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                  top_logprobs=3))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 5  # top_logprobs implies logprobs
    for k, top in enumerate(out.top_logprobs):
        expected = llm.engine.score(PROMPTS[1] + out.token_ids[:k]).log_softmax(-1).topk(3)
        assert list(top) == expected.indices.tolist()
        assert list(top.values()) == pytest.approx(expected.values.tolist(), abs=1e-5)
        assert next(iter(top)) == out.token_ids[k]  # greedy picks the most likely


def test_extreme_values_sample_without_poisoning_the_batch(llm):
    # temperature 1e-45, top_p 1e-300 and repetition_penalty 1e-300 each put inf / NaN
    # into torch.multinomial and killed the engine loop; now they sample, and a greedy
    # companion in the same batch gets exactly what it gets alone.
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], greedy)[0].token_ids
    extreme = [SamplingParams(max_tokens=6, temperature=1e-45, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1, top_p=1e-300, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1, repetition_penalty=1e-300,
                              ignore_eos=True)]
    outs = llm.generate([[11, 12, 13]] * 4, [greedy, *extreme])
    assert outs[0].token_ids == alone
    assert outs[1].token_ids == alone  # below the epsilon: greedy
    assert outs[2].token_ids == alone  # top_p that small keeps only the top token
    assert all(len(o.token_ids) == 6 for o in outs)


def test_rows_sampled_together_draw_what_each_draws_alone():
    """Sampling rows are processed together (temperature, min-p, top-k, top-p over the
    batch at once): each seeded row still draws exactly what it draws alone, whatever
    rides with it."""
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.3, top_k=5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3),
              SamplingParams(temperature=0.9, min_p=0.2, seed=4),
              SamplingParams(temperature=1.1, top_k=40, top_p=0.8, min_p=0.05, seed=5),
              SamplingParams(temperature=0)]
    requests = [Request(f"r{i}", [1], p, 0.0, output_token_ids=[2] * i)
                for i, p in enumerate(params)]
    for _ in range(3):
        together = Sampler(seed=0).sample(logits, requests)[0]
        alone = [Sampler(seed=9).sample(logits[i:i + 1], [r])[0][0]
                 for i, r in enumerate(requests)]
        assert together == alone
        logits = logits.roll(17, dims=1)
    # top-k and top-p keep what they say: a row limited to its 5 best draws among them
    best5 = set(logits[1].topk(5).indices.tolist())
    sampler, hot = Sampler(seed=0), Request("t", [1], SamplingParams(temperature=5.0, top_k=5), 0.0)
    draws = {sampler.sample(logits[1:2], [hot])[0][0] for _ in range(40)}
    assert draws <= best5 and len(draws) > 1


def test_the_race_draws_each_token_with_its_probability():
    """The batched draw (an exponential race over noise hashed from each row's seed)
    samples the distribution: 4,000 unseeded rows, each its own seed, in one batch."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
    n = 4000
    rows = [Request(f"r{i}", [1], SamplingParams(temperature=1.0), 0.0) for i in range(n)]
    tokens = Sampler(seed=0).sample(probs.log().expand(n, -1).contiguous(), rows)[0]
    freq = torch.bincount(torch.tensor(tokens), minlength=8).double() / n
    assert (freq - probs.double()).abs().max() < 0.03 and freq[5:].sum() == 0
    noise = race_noise(torch.tensor([1, 2, 1]), 50)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert noise.min() > 0 and 0.9 < noise.mean() < 1.1  # Exp(1)
    extremes = unit(torch.tensor([-1, 0, (1 << 41) - 1, 1 << 62]))  # all bits, none
    assert extremes.min() > 0 and extremes.max() < 1
