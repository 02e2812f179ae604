"""A step error is attributed to the requests whose sampling fails on their own rows:
only they end (finish_reason "error", their blocks freed) and the rest of the batch
goes on with exactly the tokens it would have produced. An error no row reproduces on
its own is the step's, and propagates. Faults are injected at the sampler boundary."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.errors import RequestFailedError
from tests.faults import FaultySampler


@pytest.fixture()
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=256)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {"a": [3, 4, 5, 6], "poison": [7, 8, 9], "b": [10, 11, 12, 13, 14]}


def run(engine) -> dict:
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


def test_only_the_request_whose_sampling_fails_ends(llm, monkeypatch):
    engine = llm.engine
    expected = {rid: out.token_ids for rid, out in zip(
        PROMPTS, llm.generate(list(PROMPTS.values()), GREEDY))}
    monkeypatch.setattr(engine.runner, "sampler",
                        FaultySampler(engine.runner.sampler,
                                      lambda r: r.request_id == "poison"))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    finished = run(engine)
    poisoned = finished.pop("poison")
    assert poisoned.finish_reason == "error" and "injected fault" in poisoned.error
    assert poisoned.token_ids == []
    assert {rid: out.token_ids for rid, out in finished.items()} == {
        rid: expected[rid] for rid in ("a", "b")}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_fault_no_row_reproduces_is_the_steps(llm, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "sampler",
                        FaultySampler(engine.runner.sampler, batches_fail=True))
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    with pytest.raises(RuntimeError, match="injected batch fault"):
        engine.step()


def test_request_failed_error_crosses_process_boundaries():
    import pickle
    err = pickle.loads(pickle.dumps(RequestFailedError("r1", "sampling failed: x")))
    assert (err.request_id, err.reason) == ("r1", "sampling failed: x")
    assert "r1" in str(err)


def test_every_row_failing_alone_is_the_steps_not_each_requests(llm, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "sampler",
                        FaultySampler(engine.runner.sampler, lambda r: True))
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
