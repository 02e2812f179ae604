"""n > 1 (and best_of) through the cluster: one prefill (one transfer, in the pair)
serves every choice, the choices stream interleaved with their index, usage counts the
prompt once; greedy choices equal HF, a seeded request is reproducible and its choice
i equals a one-sequence request with seed + i; through the official `openai` client
and the gRPC SDK, disaggregated and colocated."""
from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest

from pdserve.client import Client
from tests.cluster.conftest import wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle


def openai_client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", timeout=60,
                         max_retries=0)


def prompt_tokens_counted(srv) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", timeout=30).text
    return float(re.search(r"^pdserve:prompt_tokens_total\{[^}]*\} (\S+)$", text,
                           re.MULTILINE).group(1))


@pytest.fixture(params=["server", "colocated_server"])
def srv(request):
    return request.getfixturevalue(request.param)


def test_greedy_choices_equal_hf_from_one_prefill(srv, llama_dir):
    prompt = [random.Random(41).randrange(4, 2000) for _ in range(37)]
    counted = prompt_tokens_counted(srv)
    out = openai_client(srv).completions.create(
        model="test-llama", prompt=prompt, max_tokens=12, temperature=0, n=4,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    expected, _ = Oracle(llama_dir).generate(prompt, 12)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in out.choices] == [expected] * 4
    assert {c.text for c in out.choices} == {out.choices[0].text}
    assert out.usage.prompt_tokens == 37 and out.usage.completion_tokens == 48
    assert prompt_tokens_counted(srv) - counted == 37  # the prompt was prefilled once
    wait_all_blocks_free(srv)


def test_a_seeded_request_is_reproducible_and_its_choice_i_is_seed_plus_i(srv):
    client = openai_client(srv)
    body = dict(model="test-llama", prompt="Once upon a time", max_tokens=10,
                temperature=0.9, extra_body={"ignore_eos": True})
    first = client.completions.create(n=3, seed=77, **body)
    again = client.completions.create(n=3, seed=77, **body)
    alone = [client.completions.create(seed=77 + i, **body).choices[0].text for i in range(3)]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] == alone
    assert len(set(texts)) == 3


def test_streamed_chat_choices_carry_their_index(srv):
    messages = [{"role": "user", "content": "Tell me a story"}]
    client = openai_client(srv)
    whole = client.chat.completions.create(model="test-llama", messages=messages, n=3,
                                           max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model="test-llama", messages=messages, n=3, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, roles, reasons = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            i = choice.index
            texts[i] = texts.get(i, "") + (choice.delta.content or "")
            if i not in roles:
                roles[i] = choice.delta.role
            reasons[i] = choice.finish_reason or reasons.get(i)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_best_of_answers_the_likeliest_choices(server):
    client = openai_client(server)
    body = dict(model="test-llama", prompt="The meaning of", max_tokens=6, temperature=1.0,
                seed=5, extra_body={"ignore_eos": True})
    all_five = client.completions.create(n=5, logprobs=0, **body)
    best = client.completions.create(n=2, best_of=5, **body)
    mean = {c.text: sum(c.logprobs.token_logprobs) / 6 for c in all_five.choices}
    assert [c.text for c in best.choices] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None  # not asked for: used to rank, not shown
    assert best.usage.completion_tokens == 30  # every choice generated


@pytest.mark.parametrize("body, param", [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": "2"}, "n"), ({"best_of": 200}, "best_of"),
])
def test_bad_n_and_best_of_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=30,
                   json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_gone_mid_stream_frees_every_choice(srv):
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{srv.http_url}/v1/completions",
            json={"prompt": list(range(20, 90)), "max_tokens": 300, "stream": True, "n": 3,
                  "ignore_eos": True}) as response:
        seen = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == {0, 1, 2}:
                break  # leaving the block closes the connection mid-stream
    wait_all_blocks_free(srv)
    assert srv.router.num_inflight == 0


def test_the_sdk_gets_every_choice(server, llama_dir):
    prompt = [random.Random(43).randrange(4, 2000) for _ in range(21)]
    with Client(server.grpc_target) as client:
        out = client.generate(prompt, n=3, max_tokens=7, temperature=0, ignore_eos=True)
        seeded = client.generate(prompt, n=2, seed=9, max_tokens=7, ignore_eos=True)
        alone = client.generate(prompt, seed=10, max_tokens=7, ignore_eos=True)
    expected, _ = Oracle(llama_dir).generate(prompt, 7)
    assert [c.token_ids for c in out.choices] == [expected] * 3
    assert out.choices[0] is out and out.token_ids == expected
    assert out.usage.prompt_tokens == 21 and out.usage.completion_tokens == 21
    assert seeded.choices[1].token_ids == alone.token_ids
    assert {c.finish_reason for c in out.choices} == {"length"}


def test_streamed_prompt_logprobs_come_once_per_choice_not_with_every_chunk(server):
    body = {"prompt": "The weather today", "max_tokens": 6, "n": 2, "stream": True,
            "prompt_logprobs": 1, "ignore_eos": True}
    carried, chunks = [], 0
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{server.http_url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                chunks += 1
                if choice.get("prompt_logprobs") is not None:
                    carried.append(choice["index"])
    assert chunks >= 12 and 1 <= len(carried) <= 2 and len(set(carried)) == len(carried)
