"""Nasty inputs, over HTTP and gRPC, each followed by a canary that must succeed
promptly: every one gets the status the table says (a 4xx naming its field, or a
success where the input is odd but valid), none a 5xx, no worker dies or leaks KV,
and the server keeps serving."""
from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import httpx
import pytest

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.cluster.conftest import wait_all_blocks_free

OK_BODY = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CANARY_TIMEOUT_S = 30


@dataclass(frozen=True)
class Http:
    """A request to the HTTP front end and the status it must get (and, for a 400,
    the field its error must name)."""
    name: str
    body: object  # JSON-encoded unless bytes
    status: int
    param: str | None = None
    path: str = "/v1/completions"
    method: str = "POST"
    headers: tuple = ()


def completion(**fields) -> dict:
    return {**OK_BODY, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


HTTP = [
    # sampling numerics that once killed the engine loop
    Http("temperature 1e-45", completion(temperature=1e-45), 200),
    Http("top_p 1e-300", completion(temperature=1, top_p=1e-300), 200),
    Http("repetition_penalty 1e-300", completion(temperature=1, repetition_penalty=1e-300), 200),
    Http("repetition_penalty 1e300", completion(temperature=1, repetition_penalty=1e300), 200),
    Http("temperature 1e300", completion(temperature=1e300), 200),
    Http("temperature Infinity", b'{"prompt": [5, 6], "max_tokens": 2, "temperature": Infinity}',
         200),
    Http("temperature NaN", b'{"prompt": [5, 6], "max_tokens": 2, "temperature": NaN}', 400,
         "temperature"),
    Http("presence_penalty 3", completion(presence_penalty=3), 400, "presence_penalty"),
    Http("frequency_penalty -1e308", completion(frequency_penalty=-1e308), 400,
         "frequency_penalty"),
    Http("min_p 1.5", completion(min_p=1.5), 400, "min_p"),
    Http("top_k -2", completion(top_k=-2), 400, "top_k"),
    Http("top_k 1e20", completion(top_k=1e20, temperature=1), 200),
    Http("top_k 2.5", completion(top_k=2.5), 400, "top_k"),
    Http("seed 2**70", completion(seed=2**70, temperature=1), 200),
    Http("seed -1", completion(seed=-1, temperature=1), 200),
    Http("priority 2**70", completion(priority=2**70), 200),
    # lengths and counts
    Http("max_tokens 0", completion(max_tokens=0), 400, "max_tokens"),
    Http("max_tokens -1", completion(max_tokens=-1), 400, "max_tokens"),
    Http("max_tokens 1e12", completion(max_tokens=10**12), 400, "max_tokens"),
    Http("max_tokens as a string", completion(max_tokens="10"), 400, "max_tokens"),
    Http("max_tokens true", completion(max_tokens=True), 400, "max_tokens"),
    Http("stop: 33 strings", completion(stop=["x"] * 33), 400, "stop"),
    Http("stop: 2,000 characters", completion(stop="x" * 2000), 400, "stop"),
    Http("stop: empty string", completion(stop=""), 400, "stop"),
    Http("stop_token_ids: 2,000", completion(stop_token_ids=[1] * 2000), 400,
         "stop_token_ids"),
    Http("stop_token_ids negative", completion(stop_token_ids=[-5]), 200),
    Http("logprobs 21", completion(logprobs=21), 400, "logprobs"),
    Http("logprobs -1", completion(logprobs=-1), 400, "logprobs"),
    Http("n 0", completion(n=0), 400, "n"),
    Http("n 10,000", completion(n=10_000), 400, "n"),
    Http("n 2", completion(n=2), 200),
    Http("best_of below n", completion(n=3, best_of=2), 400, "best_of"),
    Http("best_of 3", completion(best_of=3), 200),
    Http("logit_bias past 100", completion(logit_bias={"1": 101}), 400, "logit_bias"),
    Http("logit_bias of a token past the vocabulary", completion(logit_bias={"99999": 5}),
         400, "logit_bias"),
    Http("logit_bias keyed by a word", completion(logit_bias={"the": 5}), 400, "logit_bias"),
    Http("echo a string", completion(echo="yes"), 400, "echo"),
    Http("response_format of an unknown type", completion(response_format={"type": "xml"}),
         400, "response_format"),
    Http("a schema that does not compile", completion(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
         400, "response_format"),
    Http("unknown model", completion(model="gpt-9"), 404, "model"),
    # prompts
    Http("empty prompt", completion(prompt=""), 400, "prompt"),
    Http("empty token list", completion(prompt=[]), 400, "prompt"),
    Http("negative token id", completion(prompt=[-1]), 400, "prompt"),
    Http("token id past the vocabulary", completion(prompt=[10**9]), 400, "prompt"),
    Http("lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    Http("two prompts", completion(prompt=["a", "b"]), 400, "prompt"),
    Http("nested token lists", completion(prompt=[[1, 2]]), 400, "prompt"),
    Http("null prompt", completion(prompt=None), 400, "prompt"),
    Http("object prompt", completion(prompt={"a": 1}), 400, "prompt"),
    Http("number prompt", completion(prompt=1.5), 400, "prompt"),
    Http("no prompt", {"max_tokens": 2}, 400, "prompt"),
    Http("prompt longer than the context", completion(prompt=list(range(5, 600))), 400,
         "prompt"),
    Http("100k characters", completion(prompt="word " * 20000), 400, "prompt"),
    Http("NUL, emoji and RTL text", completion(prompt="a\u0000b \U0001F600 \u202Eabc"), 200),
    # bodies
    Http("truncated JSON", b'{"prompt": [5', 400),
    Http("JSON array body", b"[]", 400),
    Http("JSON null body", b"null", 400),
    Http("empty body", b"", 400),
    Http("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400),
    Http("deeply nested JSON", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
    Http("body over the limit", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413),
    Http("text/plain body", json.dumps(OK_BODY).encode(), 415,
         headers=(("content-type", "text/plain"),)),
    Http("stream_options.include_usage a string", completion(
        stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    # chat
    Http("no messages", chat(messages=[]), 400, "messages", "/v1/chat/completions"),
    Http("message without content", chat(messages=[{"role": "user"}]), 400, "messages",
         "/v1/chat/completions"),
    Http("unknown role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
         "messages", "/v1/chat/completions"),
    Http("null content", chat(messages=[{"role": "user", "content": None}]), 400,
         "messages", "/v1/chat/completions"),
    Http("content surrogate", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         "messages[0].content", "/v1/chat/completions"),
    Http("top_logprobs without logprobs", chat(top_logprobs=5), 400, "top_logprobs",
         "/v1/chat/completions"),
    Http("max_completion_tokens 0", chat(max_completion_tokens=0), 400,
         "max_completion_tokens", "/v1/chat/completions"),
    # routes
    Http("GET on a POST route", None, 405, method="GET"),
    Http("unknown route", OK_BODY, 404, path="/v1/nonexistent"),
    Http("an Authorization header nobody asked for", OK_BODY, 200,
         headers=(("authorization", "Bearer \x7f"),)),
]


@dataclass(frozen=True)
class Grpc:
    name: str
    request: pb.GenerateRequest
    status: grpc.StatusCode


def gen(prompt=(5, 6, 7), **params) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling_params=pb.SamplingParams(**{"max_tokens": 2,
                                                                      **params}))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    return request


INVALID, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK
GRPC = [
    Grpc("no prompt", gen(prompt=None), INVALID),
    Grpc("empty text", gen(prompt=""), INVALID),
    Grpc("empty token ids", gen(prompt=[]), INVALID),
    Grpc("negative token id", gen(prompt=[-1]), INVALID),
    Grpc("int32 max token id", gen(prompt=[2**31 - 1]), INVALID),
    Grpc("temperature NaN", gen(temperature=float("nan")), INVALID),
    Grpc("temperature inf", gen(temperature=float("inf")), OK),
    Grpc("top_p NaN", gen(top_p=float("nan")), INVALID),
    Grpc("min_p NaN", gen(min_p=float("nan")), INVALID),
    Grpc("repetition_penalty -1", gen(repetition_penalty=-1), INVALID),
    Grpc("max_tokens uint32 max", gen(max_tokens=2**32 - 1), INVALID),
    Grpc("top_logprobs uint32 max", gen(top_logprobs=2**32 - 1), INVALID),
    Grpc("stop: 33 strings", gen(stop=["x"] * 33), INVALID),
    Grpc("seed int64 min", gen(seed=-2**63, temperature=1), OK),
    Grpc("priority int32 min", gen(priority=-2**31), OK),
    Grpc("a 64 KiB request id", pb.GenerateRequest(
        request_id="r" * 65536, token_ids=pb.TokenIds(ids=[5, 6])), INVALID),
    Grpc("message over the limit", gen(prompt="a" * (5 << 20)),
         grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def canary(server) -> None:
    """A small completion that must succeed promptly, and every worker in service."""
    response = httpx.post(f"{server.http_url}/v1/completions", json=OK_BODY,
                          timeout=CANARY_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert set(server.router.worker_states().values()) == {"serving"}


@pytest.mark.parametrize("case", HTTP, ids=[c.name for c in HTTP])
def test_http(server, case: Http):
    content = case.body if isinstance(case.body, bytes) else (
        None if case.body is None else json.dumps(case.body).encode())
    headers = {"content-type": "application/json", **dict(case.headers)}
    response = httpx.request(case.method, f"{server.http_url}{case.path}", content=content,
                             headers=headers, timeout=60)
    assert response.status_code == case.status, response.text[:500]
    if case.status >= 400:
        error = response.json()["error"]
        assert error["message"]
        if case.param is not None:
            assert error["param"] == case.param, error
    canary(server)


@pytest.mark.parametrize("case", GRPC, ids=[c.name for c in GRPC])
def test_grpc(server, case: Grpc):
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = pb_grpc.GenerateServiceStub(channel).Generate(case.request, timeout=60)
        try:
            list(call)
            code = OK
        except grpc.RpcError as err:
            code = err.code()
    assert code == case.status, call.details()
    canary(server)


def test_the_table_is_big_and_nothing_leaked(server):
    assert len(HTTP) + len(GRPC) >= 50
    wait_all_blocks_free(server)
