"""SamplingParams is the one declaration of the sampling fields: every field reaches
the engine through gRPC (server conversion), the SDK (kwargs and SamplingParams) and
both OpenAI HTTP bodies, with the value the caller set."""
from __future__ import annotations

from dataclasses import fields

import pytest

from pdserve.client import _request
from pdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.router.front.openai_protocol import ChatRequest, CompletionRequest
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1.sampling import FIELDS, from_proto, to_proto

# A value unlike the default for every field: a new field fails the first test until
# it is listed here, and then every path below must carry it.
NON_DEFAULT = {"max_tokens": 7, "temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.25,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.25,
               "seed": 11, "stop": ("xy",), "stop_token_ids": (5,), "ignore_eos": True,
               "logprobs": True, "top_logprobs": 3, "priority": 2, "min_tokens": 2,
               "logit_bias": {5: -1.5},
               "structured_outputs": StructuredOutputsParams(regex="a+b"),
               "prompt_logprobs": 2, "n": 3}


def test_every_field_has_a_non_default_value_here():
    assert set(NON_DEFAULT) == {f.name for f in fields(SamplingParams)}
    for f in fields(SamplingParams):
        assert NON_DEFAULT[f.name] != f.default, f.name


def test_the_proto_message_has_exactly_the_sampling_fields():
    assert set(pb.SamplingParams.DESCRIPTOR.fields_by_name) == set(FIELDS)


def test_an_empty_proto_message_means_every_default():
    assert from_proto(pb.SamplingParams()) == SamplingParams()


def _expected(name: str) -> SamplingParams:
    return SamplingParams(**{name: NON_DEFAULT[name]})


@pytest.mark.parametrize("name", FIELDS)
def test_grpc_and_the_sdk_carry_the_field(name):
    expected = _expected(name)
    assert from_proto(to_proto(expected)) == expected
    by_kwarg = _request("hi", "", None, {name: NON_DEFAULT[name]})
    assert from_proto(by_kwarg.sampling_params) == expected
    by_object = _request([1, 2], "", expected, {})
    assert from_proto(by_object.sampling_params) == expected


def _openai_bodies(name: str) -> list[tuple[type, dict]]:
    value = NON_DEFAULT[name]
    if name == "logprobs":
        return [(CompletionRequest, {"logprobs": 0}), (ChatRequest, {"logprobs": True})]
    if name == "top_logprobs":
        return [(CompletionRequest, {"logprobs": value}),
                (ChatRequest, {"logprobs": True, "top_logprobs": value})]
    if name == "logit_bias":  # JSON's keys are strings
        return [(model, {name: {"5": -1.5}}) for model in (CompletionRequest, ChatRequest)]
    if name == "structured_outputs":
        return [(model, body) for model in (CompletionRequest, ChatRequest)
                for body in ({name: {"regex": "a+b"}}, {"guided_regex": "a+b"})]
    plain = list(value) if isinstance(value, tuple) else value
    bodies = [(CompletionRequest, {name: plain}), (ChatRequest, {name: plain})]
    if name == "max_tokens":
        bodies.append((ChatRequest, {"max_completion_tokens": value}))
    return bodies


@pytest.mark.parametrize("name", FIELDS)
def test_both_openai_bodies_carry_the_field(name):
    expected = _expected(name)
    for model, body in _openai_bodies(name):
        extra = {"prompt": "hi"} if model is CompletionRequest else {
            "messages": [{"role": "user", "content": "hi"}]}
        assert model(**extra, **body).sampling_params() == expected, (model.__name__, body)


def test_openai_schema_describes_the_derived_fields():
    props = CompletionRequest.model_json_schema()["properties"]
    assert props["repetition_penalty"]["default"] == 1.0
    assert "over prompt and output tokens" in props["repetition_penalty"]["description"]


def test_the_sdk_takes_openais_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = _request("hi", "", None, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    params = from_proto(request.sampling_params)
    assert params.structured_outputs == StructuredOutputsParams(json=schema)
    assert from_proto(_request("hi", "", None, {"response_format": {"type": "text"}}
                               ).sampling_params).structured_outputs is None
    with pytest.raises(TypeError):
        _request("hi", "", None, {"response_format": {"type": "json_object"},
                                  "structured_outputs": StructuredOutputsParams(regex="a")})
