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
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
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
