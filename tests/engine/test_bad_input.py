"""Bad input raises InvalidRequestError naming the field; the engine keeps serving."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=256)


@pytest.mark.parametrize("make_params, field", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.5), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=-7), "top_k"),
])
def test_bad_sampling_fields(make_params, field):
    with pytest.raises(InvalidRequestError) as err:
        make_params()
    assert err.value.field == field and field in str(err.value)


@pytest.mark.parametrize("prompt, max_tokens, field", [
    ("", 4, "prompt"),
    ([], 4, "prompt"),
    ([1, 2, 10**6], 4, "prompt"),
    ([1, -1], 4, "prompt"),
    (list(range(1, 300)), 4, "prompt"),
    (list(range(1, 200)), 100, "max_tokens"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm, prompt, max_tokens, field):
    engine = llm.engine
    engine.add_request("in-flight", [3, 4, 5], SamplingParams(max_tokens=8, temperature=0,
                                                               ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, SamplingParams(max_tokens=max_tokens))
    assert err.value.field == field
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["in-flight"] and len(outs[0].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_prompt_in_a_batch_runs_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], [1, 10**6]], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
               .token_ids) == 4


def test_abort_frees_blocks_at_the_next_step(llm):
    engine = llm.engine
    engine.add_request("long", list(range(1, 100)), SamplingParams(max_tokens=100,
                                                                  ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("long")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("long", "abort")]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()
