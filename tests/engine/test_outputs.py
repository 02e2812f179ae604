"""A step's output costs the same at the request's first token and its thousandth: it
holds the request's own output lists and how much of them it saw (no copy per step),
and what it reads back is what it saw, after later steps too."""
from pdserve import LLM, SamplingParams


def test_a_step_output_shares_the_request_s_lists_and_reads_its_own_moment(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request("r", [3, 4, 5, 6], params)
    steps = []
    while engine.has_unfinished():
        steps.extend(o for o in engine.step() if o.request_id == "r")
    final = steps[-1]
    assert final.finished and len(final.token_ids) == 20 == final.num_output_tokens
    lists = {id(o.outputs.token_ids) for o in steps}
    assert len(lists) == 1  # every step's output holds the one list: nothing copied
    for k, out in enumerate(steps, start=1):  # read after the request ended
        assert out.token_ids == final.token_ids[:k] and out.num_output_tokens == k
        assert out.logprobs == final.logprobs[:k]
        assert out.new_token_ids == [final.token_ids[k - 1]]
        assert out.new_logprobs == [final.logprobs[k - 1]]
