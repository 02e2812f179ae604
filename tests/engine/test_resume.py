"""A request moved to another engine mid-stream (migration by replay) goes on exactly
where it stopped: its outputs so far run as outputs (max_tokens, seeded draws,
penalties, stop strings count them), and its text resumes after what its client had,
a held-back tail included."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(40, 75))


def _engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=8 << 20,
                                              max_model_len=256))


def _run(engine: LLMEngine, request_id: str, params: SamplingParams, **resume):
    """Each step's (new token ids, new text), and the last output."""
    engine.add_request(request_id, PROMPT, params, **resume)
    steps, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                steps.append((out.new_token_ids, out.new_text))
                last = out
    return steps, last


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_resumed_request_continues_the_uninterrupted_tokens_and_text(llama_dir, sampling):
    engine = _engine(llama_dir)
    params = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                            logprobs=1, **({"temperature": 0} if sampling == "greedy"
                                           else {"temperature": 1.0, "seed": 1234}))
    # Two characters from the middle of its text: a stop string that matches late,
    # so text is held back before it.
    text = _run(engine, "probe", params)[1].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = replace(params, stop=(stop,))
    whole, end = _run(engine, "whole", params)
    tokens = [t for ids, _ in whole for t in ids]
    assert end.finish_reason == "stop" and end.stop_reason == stop
    for cut in (1, len(whole) // 2, len(whole) - 1):  # steps its first engine made
        sent = whole[:cut]
        before = [t for ids, _ in sent for t in ids]
        text_sent = "".join(text for _, text in sent)
        rest, last = _run(engine, f"moved-{cut}", params, output_token_ids=before,
                          text_sent=len(text_sent))
        assert before + [t for ids, _ in rest for t in ids] == tokens
        assert text_sent + "".join(text for _, text in rest) == end.text
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        assert last.num_output_tokens == end.num_output_tokens
        assert last.new_logprobs == pytest.approx(end.new_logprobs, abs=1e-4)  # sampled here
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_counts_the_outputs_a_moved_request_brought(llama_dir):
    engine = _engine(llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    steps, last = _run(engine, "moved", params, output_token_ids=[5, 6, 7, 8])
    assert [len(ids) for ids, _ in steps] == [1, 1] and last.finish_reason == "length"
    assert last.token_ids[:4] == [5, 6, 7, 8] and last.num_output_tokens == 6
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("spent", PROMPT, params, output_token_ids=[5] * 6)
    assert err.value.field == "output_token_ids"
    assert not engine.has_unfinished()
