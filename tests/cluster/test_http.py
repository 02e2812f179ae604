"""The OpenAI-compatible HTTP API of the disaggregated cluster: the official `openai`
client, SSE streaming with usage, OpenAI-shaped 400s naming the field, 429 with
Retry-After, client disconnects freeing blocks, and /metrics."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import httpx
import openai
import pytest

from tests.cluster.conftest import wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", timeout=60,
                         max_retries=0)


def test_completions_with_token_ids_match_hf(client, llama_dir):
    oracle = Oracle(llama_dir)
    rng = random.Random(31)
    for n in (4, 45, 120):
        prompt = [rng.randrange(4, 2000) for _ in range(n)]
        out = client.completions.create(model="test-llama", prompt=prompt, max_tokens=8,
                                        temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        expected, _ = oracle.generate(prompt, 8)
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == expected
        assert choice.finish_reason == "length"
        assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 8


def test_streaming_completion_with_usage(client):
    full = client.completions.create(model="test-llama", prompt="The weather", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model="test-llama", prompt="The weather", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "Say something"}]
    out = client.chat.completions.create(model="test-llama", messages=messages, max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model="test-llama", messages=messages, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        out.choices[0].message.content


def test_logprobs_with_top_alternatives(client):
    # Token 1 is the prefill worker's, the rest the decode worker's: all carry their tops.
    out = client.completions.create(model="test-llama", prompt="Tell me", max_tokens=4,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and logprob == max(top.values())
        assert 2 <= len(top) <= 3  # the 2 most likely, and the chosen token
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="test-llama", messages=messages, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[1].logprob <= entry.logprob
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="test-llama", messages=messages, max_tokens=3,
                                       top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_models_lists_max_model_len(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["test-llama"]
    assert models[0].model_extra["max_model_len"] == 512


@pytest.mark.parametrize("body, param", [
    ({"model": "test-llama"}, "prompt"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": [1, 99999999]}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": list(range(1, 500)), "max_tokens": 100}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "hi", "logit_bias": {"99999": 10}}, "logit_bias"),  # beyond the vocabulary
    ({"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"prompt": "hi", "min_tokens": 17}, "min_tokens"),  # past max_tokens (16)
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"prompt": "hi", "structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"prompt": "hi", "guided_grammar": "root ::= nothing"}, "guided_grammar"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "min_p": "x"}, "min_p"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(33)]}, "stop"),
    ({"prompt": "hi", "stop": ["x" * 1025]}, "stop"),
    ({"prompt": "hi " * 100_000}, "prompt"),  # cannot fit: refused before tokenizing
    ({"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: was a 500
    ({"prompt": "hi", "stop": ["\udfff"]}, "stop"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    response = _post_ascii_json(f"{server.http_url}/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    ok = httpx.post(f"{server.http_url}/v1/completions",
                    json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_an_unknown_model_is_404_model_not_found(server):
    response = httpx.post(f"{server.http_url}/v1/completions",
                          json={"prompt": "hi", "model": "gpt-4"}, timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server):
    limit = server.router.config.max_request_bytes
    big = b'{"prompt": "' + b"x" * limit + b'"}'
    declared = httpx.post(f"{server.http_url}/v1/completions", content=big, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and "exceeds" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]
    chunked = httpx.post(f"{server.http_url}/v1/completions", content=chunks(), timeout=60,
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    ok = httpx.post(f"{server.http_url}/v1/completions",
                    json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200


def _post_ascii_json(url: str, body: dict) -> httpx.Response:
    """JSON with \\u escapes, the way a lone surrogate reaches a server (httpx would
    refuse to encode it as UTF-8 itself)."""
    return httpx.post(url, content=json.dumps(body), timeout=30,
                      headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),  # was accepted (200)
    ([{"role": "user", "content": "x\ud83d"}], "messages[0].content"),
])
def test_bad_chat_messages_are_400(server, messages, param):
    response = _post_ascii_json(f"{server.http_url}/v1/chat/completions",
                                {"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("sampling", [
    {"temperature": 1e-45},
    {"temperature": 1, "top_p": 1e-300},
    {"temperature": 1, "repetition_penalty": 1e-300},
    {"temperature": 1, "repetition_penalty": 1e300, "top_k": 3},
])
def test_extreme_sampling_values_cannot_kill_a_worker(server, sampling):
    # Each of these used to put inf / NaN into the batch and kill the engine loop.
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True, **sampling}
    response = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    canary = httpx.post(f"{server.http_url}/v1/completions",
                        json={"prompt": [9, 10], "max_tokens": 2, "ignore_eos": True},
                        timeout=30)
    assert canary.status_code == 200 and canary.json()["usage"]["completion_tokens"] == 2


def test_overload_is_429_with_retry_after(server):
    router = server.router
    saved = router.requests.config  # where max_inflight is read
    router.requests.config = replace(saved, max_inflight=1)
    try:
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{server.http_url}/v1/completions",
                json={"prompt": [7, 8, 9], "max_tokens": 500, "stream": True,
                      "ignore_eos": True}) as held:
            # Headers arrive with the first token: the first request holds the only slot
            # until its stream ends, and this test has read none of it yet.
            assert held.status_code == 200 and router.num_inflight == 1
            response = http.post(f"{server.http_url}/v1/completions",
                                 json={"prompt": [1, 2], "max_tokens": 2})
            assert response.status_code == 429
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
    finally:
        router.requests.config = saved
    wait_all_blocks_free(server)


def test_client_disconnect_mid_stream_frees_blocks(server):
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{server.http_url}/v1/completions",
            json={"prompt": list(range(20, 120)), "max_tokens": 400, "stream": True,
                  "ignore_eos": True}) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) >= 3:
                break  # leaving the block closes the connection mid-stream
    assert len(events) == 3
    wait_all_blocks_free(server)


def test_health_ready_and_metrics(server, client):
    client.completions.create(model="test-llama", prompt="metrics please", max_tokens=3,
                              extra_body={"ignore_eos": True})
    assert httpx.get(f"{server.http_url}/health").json() == {
        "status": "ok", "workers": {"prefill-0": "serving", "decode-0": "serving"}}
    assert httpx.get(f"{server.http_url}/ready").status_code == 200
    text = httpx.get(f"{server.http_url}/metrics").text
    for name in ("pdserve:time_to_first_token_seconds_bucket",
                 "pdserve:inter_token_latency_seconds_bucket",
                 "pdserve:e2e_request_latency_seconds_count", "pdserve:num_requests_running",
                 "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc",
                 "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total",
                 "pdserve:num_preemptions",
                 # the pools, on a router without the planner too
                 'pdserve:pool_workers{model_name="test-llama",role="decode",'
                 'state="serving"} 1.0',
                 'pdserve:pool_workers{model_name="test-llama",role="prefill",'
                 'state="pending"} 0.0'):
        assert name in text, name
    for lease in ("begin", "transfer", "start"):
        assert f'pdserve:kv_lease_expiries{{lease="{lease}",model_name="test-llama"}}' in text
    count = [line for line in text.splitlines()
             if line.startswith("pdserve:e2e_request_latency_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                      "strict": True}}


def _xgrammar_oracle(llama_dir):
    from pdserve.engine.model_config import ModelConfig
    from tests.engine.test_structured_outputs import XgrammarOracle
    return XgrammarOracle(llama_dir, list(ModelConfig.from_dir(llama_dir).eos_token_ids))


def test_structured_outputs_through_the_openai_client(client, llama_dir):
    """Through the disaggregated pair (the prefill worker's first token constrained,
    the decode worker going on from it): each constraint's output is valid, streamed
    or not, and equals HF generate with xgrammar's processor."""
    from pdserve.engine.sampling_params import StructuredOutputsParams
    oracle = _xgrammar_oracle(llama_dir)
    rng = random.Random(7)
    cases = [({"response_format": JSON_SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
             ({"structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}},
              StructuredOutputsParams(regex="[a-z]{3,6}-[0-9]{2}")),
             ({"structured_outputs": {"choice": ["left", "right"]}},
              StructuredOutputsParams(choice=("left", "right")))]
    for body, constraint in cases:
        prompt = [rng.randrange(4, 2000) for _ in range(rng.randrange(5, 60))]
        expected = oracle.generate(prompt, 40, constraint)
        out = client.completions.create(model="test-llama", prompt=prompt, max_tokens=40,
                                        temperature=0, extra_body={**body,
                                                                   "return_token_ids": True})
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == expected and choice.finish_reason == "stop"
        chunks = list(client.completions.create(
            model="test-llama", prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={**body, "return_token_ids": True}))
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected
        if constraint.json:
            assert set(json.loads(choice.text)) == {"ok", "color"}
        elif constraint.choice:
            assert choice.text in constraint.choice
    chat = client.chat.completions.create(
        model="test-llama", messages=[{"role": "user", "content": "Pick a color"}],
        max_tokens=40, temperature=0, response_format=JSON_SCHEMA)
    assert json.loads(chat.choices[0].message.content)["color"] in ("red", "green", "blue")
    anything = client.chat.completions.create(
        model="test-llama", messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=24, temperature=0, response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length"
                                     or isinstance(json.loads(text), dict))


def test_logprobs_under_a_constraint_are_json(client):
    """A masked token's logprob is -9999 (vLLM's floor), never -inf: JSON carries it,
    whole or streamed."""
    kwargs = dict(model="test-llama", messages=[{"role": "user", "content": "Yes or no?"}],
                  max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
                  extra_body={"guided_choice": ["yes", "no"]})
    out = client.chat.completions.create(**kwargs)
    tops = [t.logprob for c in out.choices[0].logprobs.content for t in c.top_logprobs]
    assert -9999.0 in tops and all(v >= -9999.0 for v in tops)
    assert out.choices[0].message.content in ("yes", "no")
    assert list(client.chat.completions.create(stream=True, **kwargs))


def test_logit_bias_and_min_tokens_through_the_openai_client(client, llama_dir):
    """OpenAI's documented effects: -100 bans a token, +100 all but forces it; eos
    comes no earlier than min_tokens."""
    from pdserve.engine.model_config import ModelConfig
    eos = ModelConfig.from_dir(llama_dir).eos_token_ids[0]
    prompt = [rng for rng in range(30, 50)]
    free = client.completions.create(model="test-llama", prompt=prompt, max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True,
                                                                "return_token_ids": True})
    banned = free.choices[0].model_extra["token_ids"][0]
    out = client.completions.create(model="test-llama", prompt=prompt, max_tokens=6,
                                    temperature=0, logit_bias={str(banned): -100},
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert banned not in out.choices[0].model_extra["token_ids"]
    forced = client.completions.create(model="test-llama", prompt=prompt, max_tokens=12,
                                       temperature=0, logit_bias={str(eos): 100},
                                       extra_body={"min_tokens": 4, "return_token_ids": True})
    ids = forced.choices[0].model_extra["token_ids"]
    assert forced.choices[0].finish_reason == "stop" and len(ids) == 5 and ids[-1] == eos
    assert eos not in ids[:4]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["unit"],
                   "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_tool_calls_through_the_openai_client(client, server):
    """Tools reach the prompt through the chat template; a named choice and
    "required" return valid calls with ids (streamed, the deltas OpenAI's client
    assembles to the same call); a tool result goes back as a role "tool" message."""
    messages = [{"role": "user", "content": "What is the weather?"}]
    plain = client.chat.completions.create(model="test-llama", messages=messages,
                                           max_tokens=2, temperature=0)
    named = client.chat.completions.create(
        model="test-llama", messages=messages, tools=[WEATHER, NOW], max_tokens=40,
        temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools rendered
    (call,) = named.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None
    streamed = list(client.chat.completions.create(
        model="test-llama", messages=messages, tools=[WEATHER, NOW], max_tokens=40,
        temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or ())]
    assert all(c.choices[0].delta.content is None for c in streamed
               if c.choices[0].delta.tool_calls)  # OpenAI's: no "" content beside calls
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # A random model goes on adding calls to the array: closing it is made likely
    # (logit_bias), as a trained model closes it.
    tokenizer = server.router.tokenizer
    close = {str(ids[0]): 8 for text in ("]", "}]")
             if len(ids := tokenizer.encode(text, add_special_tokens=False)) == 1}
    assert close
    required = client.chat.completions.create(
        model="test-llama", messages=messages, tools=[WEATHER, NOW], max_tokens=60,
        temperature=0, tool_choice="required", logit_bias=close)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls", required.choices[0]
    for c in calls:
        assert c.function.name in ("get_weather", "now")
        assert isinstance(json.loads(c.function.arguments), dict)
    one = client.chat.completions.create(
        model="test-llama", messages=messages, tools=[WEATHER, NOW], max_tokens=60,
        temperature=0, tool_choice="required", logit_bias=close, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    answered = client.chat.completions.create(
        model="test-llama", tools=[WEATHER], max_tokens=4, temperature=0, messages=[
            *messages, {"role": "assistant", "content": None, "tool_calls": [
                call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees"}])
    assert answered.choices[0].message.role == "assistant"
    assert answered.usage.prompt_tokens > named.usage.prompt_tokens


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize and /detokenize: a prompt's ids as a completion would count
    them, a chat's through the template (tools included), and back."""
    url = server.http_url
    out = httpx.post(f"{url}/tokenize", json={"prompt": "The weather today",
                                             "return_token_strs": True}, timeout=30).json()
    assert out["tokens"] == server.router.tokenizer.encode("The weather today")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert "".join(out["token_strs"][1:]).replace("Ġ", " ").strip() == "The weather today"
    completion = httpx.post(f"{url}/v1/completions", json={
        "prompt": "The weather today", "max_tokens": 1}, timeout=30).json()
    assert completion["usage"]["prompt_tokens"] == out["count"]
    messages = [{"role": "user", "content": "Say something"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 1}, timeout=30).json()
    counted = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [WEATHER]},
                         timeout=30).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": counted["tokens"]},
                      timeout=30).json()["prompt"]
    assert "<|im_start|>user\nSay something" in text and '"get_weather"' in text
    for body, path, param in [({"tokens": [99999]}, "/detokenize", "tokens"),
                              ({"prompt": "x", "messages": messages}, "/tokenize", "prompt"),
                              ({}, "/tokenize", "prompt")]:
        response = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_echo_and_prompt_logprobs_as_lm_eval_scores_them(client, server, llama_dir):
    """lm-evaluation-harness' loglikelihood request (echo, logprobs, max_tokens 1)
    through the disaggregated pair: the prompt's text first, its tokens' logprobs
    (null for the first) equal to HF's log-softmax in fp32, then the completion's;
    vLLM's prompt_logprobs likewise, streamed or not."""
    import torch
    oracle = _xgrammar_oracle(llama_dir)
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = server.router.tokenizer.encode(prompt)
    with torch.no_grad():
        hf = torch.log_softmax(oracle.model(torch.tensor([ids])).logits[0], dim=-1)
    out = client.completions.create(model="test-llama", prompt=prompt, max_tokens=1,
                                    temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(hf[pos - 1, ids[pos]].item(), abs=1e-3)
        assert len(lp.top_logprobs[pos]) in (2, 3)  # the top 2, and the prompt's own
    assert lp.top_logprobs[0] is None and out.usage.prompt_tokens == len(ids)
    plain = client.completions.create(model="test-llama", prompt=prompt, max_tokens=1,
                                      temperature=0, logprobs=2)
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0])
    vllm = httpx.post(f"{server.http_url}/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}).json()["choices"][0]
    scored = vllm["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for pos in range(1, len(ids)):
        entry = scored[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(hf[pos - 1, ids[pos]].item(), abs=1e-3)
        assert entry["rank"] >= 1 and entry["decoded_token"]
    chunks = list(client.completions.create(model="test-llama", prompt=prompt, max_tokens=3,
                                            temperature=0, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks).startswith(prompt)
    assert chunks[0].choices[0].text.startswith(prompt)
