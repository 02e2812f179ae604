"""The disaggregated cluster behind the gRPC API, through the SDK: real local Ray,
a real grpc.aio server on port 0. Greedy outputs equal HF; bad input gets
INVALID_ARGUMENT naming the field and the server keeps serving; cancel frees blocks."""
from __future__ import annotations

import asyncio
import json
import random
import threading
from dataclasses import replace

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient, Client, InvalidArgumentError, OverloadedError, PdserveError
from tests.cluster.conftest import generate_concurrently, wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle


def test_concurrent_requests_through_the_sdk_match_hf(server, llama_dir):
    oracle = Oracle(llama_dir)
    rng = random.Random(21)
    shared = [rng.randrange(4, 2000) for _ in range(40)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(4, 2000) for _ in range(n)]
               for i, n in enumerate([3, 12, 50, 90, 140, 25, 7, 64])]
    outs = generate_concurrently(server, prompts, 10)
    for prompt, out in zip(prompts, outs):
        expected, _ = oracle.generate(prompt, 10)
        assert out.token_ids == expected
        assert out.finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 10
        assert out.ttft_s is not None and out.e2e_s >= out.ttft_s


def test_sampling_through_prefill_and_decode_equals_one_engine(server, llama_dir):
    # P samples token 0 and D the rest; a seed still gives what one engine gives, and
    # so do penalties over prompt and output tokens.
    prompts = [list(range(10, 30)), list(range(200, 290))]
    sampling = dict(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True,
                    min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.3,
                    presence_penalty=0.2)
    offline = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20)
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(**sampling))]
    greedy = [o.token_ids for o in offline.generate(prompts, SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True))]
    assert expected != greedy
    with Client(server.grpc_target) as client:
        assert [client.generate(p, **sampling).token_ids for p in prompts] == expected
        tops = client.generate(prompts[0], max_tokens=4, temperature=0, ignore_eos=True,
                               top_logprobs=3)
    want = offline.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0,
                                                       ignore_eos=True, top_logprobs=3))[0]
    assert len(tops.top_logprobs) == len(tops.logprobs) == 4
    for got, exp in zip(tops.top_logprobs, want.top_logprobs):
        assert list(got) == list(exp) and list(got.values()) == pytest.approx(list(exp.values()))
    http = httpx.post(f"{server.http_url}/v1/completions", timeout=60, json={
        "prompt": prompts[1], "return_token_ids": True, **sampling})
    assert http.json()["choices"][0]["token_ids"] == expected[1]


def test_structured_outputs_and_min_tokens_through_the_sdk(server, llama_dir):
    """The new sampling fields through gRPC: a response_format (OpenAI's shape) and a
    choice constraint end valid and equal one engine's output; min_tokens holds eos
    back (pushed up by logit_bias)."""
    from pdserve.engine.sampling_params import StructuredOutputsParams
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    offline = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20)
    eos = offline.engine.eos_token_ids[0]
    prompt = list(range(300, 340))
    cases = [({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}, StructuredOutputsParams(json=schema)),
        ({"structured_outputs": StructuredOutputsParams(choice=("up", "down"))},
         StructuredOutputsParams(choice=("up", "down")))]
    with Client(server.grpc_target) as client:
        for kwargs, constraint in cases:
            got = client.generate(prompt, max_tokens=30, temperature=0, **kwargs)
            want = offline.generate(prompt, SamplingParams(
                max_tokens=30, temperature=0, structured_outputs=constraint))[0]
            assert got.token_ids == want.token_ids and got.finish_reason == "stop"
        assert json.loads(client.generate(prompt, max_tokens=30, temperature=0,
                                          **cases[0][0]).text) in ({"ok": True}, {"ok": False})
        held = client.generate(prompt, max_tokens=10, temperature=0, min_tokens=3,
                               logit_bias={eos: 100.0})
    assert held.token_ids[3:] == [eos] and eos not in held.token_ids[:3]


def test_prompt_logprobs_through_the_sdk(server, colocated_server, llama_dir):
    """Prompt logprobs reach the SDK on the first chunk, from the prefill worker of a
    pair and from a colocated worker alike, equal to one engine's."""
    prompt = list(range(400, 430))
    offline = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20)
    want = offline.generate(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                   prompt_logprobs=2))[0].prompt_logprobs
    for srv in (server, colocated_server):
        with Client(srv.grpc_target) as client:
            got = client.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=2)
            plain = client.generate(prompt, max_tokens=2, temperature=0)
        assert plain.prompt_logprobs is None and got.prompt_logprobs[0] is None
        assert len(got.prompt_logprobs) == len(prompt)
        for entry, (logprob, rank, top) in zip(got.prompt_logprobs[1:], want[1:]):
            assert entry.logprob == pytest.approx(logprob, abs=1e-5) and entry.rank == rank
            assert list(entry.top) == list(top)


def test_text_prompt_and_stream(server):
    with Client(server.grpc_target) as client:
        chunks = list(client.generate_stream("Hello there", max_tokens=6, temperature=0,
                                             ignore_eos=True))
        full = client.generate("Hello there", max_tokens=6, temperature=0, ignore_eos=True)
    assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids


@pytest.mark.parametrize("prompt, sampling, field", [
    ("", {}, "prompt"),
    ([1, 10**6], {}, "prompt"),
    ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
    ([1, 2, 3], {"temperature": -1.0}, "temperature"),
    ([1, 2, 3], {"top_p": 1.5}, "top_p"),
    ([1, 2, 3], {"frequency_penalty": -2.5}, "frequency_penalty"),
    ([1, 2, 3], {"min_p": 2.0}, "min_p"),
    (list(range(1, 500)), {"max_tokens": 100}, "max_tokens"),
    ("hi " * 100_000, {}, "prompt"),  # cannot fit the context: refused before tokenizing
    ([1, 2, 3], {"stop": ["x" * 1025]}, "stop"),
    ([1, 2, 3], {"logit_bias": {99999: 1.0}}, "logit_bias"),
    ([1, 2, 3], {"min_tokens": 20}, "min_tokens"),
    ([1, 2, 3], {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "structured_outputs"),
])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(server, prompt, sampling,
                                                                     field):
    with Client(server.grpc_target) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.generate(prompt, **sampling)
        assert field in err.value.message
        assert len(client.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_message_over_the_limit_is_refused_and_the_server_keeps_serving(server):
    limit = server.router.config.max_request_bytes
    with Client(server.grpc_target) as client:  # not retried: no retry-after
        with pytest.raises(PdserveError) as err:
            client.generate("x" * (limit + 1))
        assert not isinstance(err.value, OverloadedError)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(client.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_cancel_mid_stream_frees_blocks_on_both_workers(server):
    async def cancel_after_a_few_tokens():
        async with AsyncClient(server.grpc_target) as client:
            seen = 0
            async for chunk in client.generate_stream(list(range(10, 100)), max_tokens=400,
                                                      ignore_eos=True, temperature=0):
                seen += len(chunk.token_ids)
                if seen >= 3:
                    break  # leaving the stream cancels the RPC
            return seen

    assert asyncio.run(cancel_after_a_few_tokens()) >= 3
    wait_all_blocks_free(server)


def test_abort_rpc_ends_the_stream(server):
    with Client(server.grpc_target) as client:
        stream = client.generate_stream(list(range(10, 60)), request_id="to-abort",
                                        max_tokens=400, ignore_eos=True)
        first = next(stream)
        assert client.abort("to-abort")
        rest = list(stream)
    assert (rest[-1] if rest else first).finish_reason == "abort"
    assert not Client(server.grpc_target).abort("no-such-request")


def test_health_reflection_and_model_info(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.GenerateService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(reflect.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in answer.list_services_response.service}
        assert {"pdserve.v1.GenerateService", "grpc.health.v1.Health"} <= names
    info = Client(server.grpc_target).model_info()
    assert info.max_model_len == 512 and info.vocab_size > 0 and info.has_chat_template


def test_overload_is_resource_exhausted_and_the_sdk_retries(server):
    router = server.router
    saved = router.requests.config  # where max_inflight is read
    router.requests.config = replace(saved, max_inflight=1)
    try:
        with Client(server.grpc_target, max_retries=0) as impatient, \
                Client(server.grpc_target, max_retries=8, backoff_s=0.05) as patient:
            held = impatient.generate_stream([7, 8, 9], max_tokens=500, ignore_eos=True)
            next(held)  # the only slot is taken until this stream is drained
            with pytest.raises(OverloadedError) as err:
                impatient.generate([1, 2], max_tokens=2)
            assert err.value.retry_after_s == saved.retry_after_s
            drain = threading.Thread(target=lambda: list(held))
            drain.start()  # the slot frees once the held request ends
            out = patient.generate([1, 2], max_tokens=2, ignore_eos=True)
            drain.join(30)
        assert len(out.token_ids) == 2
    finally:
        router.requests.config = saved
