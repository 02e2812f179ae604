"""The OpenAI bodies as the HTTP front parses them (router/front/body_parser.py),
without a server: a known field pdserve does not implement yet is refused with a 400
naming it, never dropped; its no-op values pass; chat content comes as a string or
as text parts."""
from __future__ import annotations

import json

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.validation import PromptLimits
from pdserve.router.front.body_parser import parse
from pdserve.router.front.openai_protocol import ChatRequest, CompletionRequest

LIMITS = PromptLimits(max_model_len=4096, max_prompt_chars=1 << 20)
CHAT = [{"role": "user", "content": "hi"}]


def body(model, **fields):
    return parse(model, json.dumps(fields).encode(), LIMITS)


@pytest.mark.parametrize("model, fields, param", [
    (ChatRequest, {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f g"}}]}, "tools"),
    (ChatRequest, {"messages": CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    (ChatRequest, {"messages": CHAT, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    (ChatRequest, {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    (CompletionRequest, {"prompt": "hi", "structured_outputs": {"structural_tag": "a"}},
     "structured_outputs"),
    (CompletionRequest, {"prompt": "hi", "response_format": {"type": "xml"}},
     "response_format"),
    (CompletionRequest, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (CompletionRequest, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    (CompletionRequest, {"prompt": "hi", "suffix": "!"}, "suffix"),
    (CompletionRequest, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    (ChatRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
    (ChatRequest, {"messages": [{"role": "user", "content": []}]}, "messages"),
])
def test_a_field_not_served_yet_is_refused_naming_it(model, fields, param):
    result = body(model, **fields)
    assert isinstance(result, tuple), f"{param} was accepted: {result!r}"
    message, named = result
    assert named == param and message


def test_their_no_op_values_pass():
    chat = body(ChatRequest, messages=CHAT, response_format={"type": "text"}, tools=[],
                tool_choice="none", functions=[], guided_json=None, logit_bias={},
                min_tokens=0)
    assert isinstance(chat, ChatRequest)
    completion = body(CompletionRequest, prompt="hi", response_format=None, suffix=None)
    assert isinstance(completion, CompletionRequest)


def test_chat_content_parts_are_joined_text():
    chat = body(ChatRequest, messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "text", "text": "second"}]}])
    assert chat.template_messages() == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "first\nsecond"}]


def test_a_priority_beyond_64_bits_ranks_as_the_bound_in_the_router():
    """Any integer priority is accepted (tests/cluster/test_nasty_inputs.py); the
    router's int64 arrays hold one past 64 bits as the bound. Schemathesis found
    -1.5e25 with a TPOT SLO: a 500 in the budget rows before."""
    from types import SimpleNamespace

    from pdserve.router.policy.budget_rows import BudgetRows, int64_priority
    assert int64_priority(-15326234169878663483359232) == -(1 << 63)
    assert int64_priority(1 << 70) == (1 << 63) - 1 and int64_priority(-3) == -3
    rows = BudgetRows()
    rows.join(SimpleNamespace(tpot_slo_s=0.05, priority=-15326234169878663483359232,
                              max_tokens=4, num_output_tokens=0, first_token_at=None))
    assert len(rows) == 1


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "json", json.dumps(SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_object", True),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ("yes", "no")),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
    ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
    ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA)),
    ({"guided_choice": ["a", "b"]}, "choice", ("a", "b")),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
])
def test_constraints_reach_sampling_params(fields, kind, value):
    for parsed in (body(CompletionRequest, prompt="hi", **fields),
                   body(ChatRequest, messages=CHAT, **fields)):
        constraint = parsed.sampling_params().structured_outputs
        assert constraint.kind == kind and getattr(constraint, kind) == value
        assert constraint.disable_any_whitespace  # no free whitespace by default
        assert parsed.constraint()[1] == next(iter(fields))


def test_text_response_format_is_unconstrained_and_two_constraints_are_refused():
    assert body(ChatRequest, messages=CHAT, response_format={"type": "text"}
                ).sampling_params().structured_outputs is None
    both = body(CompletionRequest, prompt="hi", response_format={"type": "json_object"},
                guided_regex="a")
    with pytest.raises(InvalidRequestError) as err:
        both.sampling_params()
    assert err.value.field == "guided_regex"
    two_kinds = body(CompletionRequest, prompt="hi",
                     structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidRequestError) as err:
        two_kinds.sampling_params()
    assert err.value.field == "structured_outputs"


def test_logit_bias_and_min_tokens():
    params = body(CompletionRequest, prompt="hi", logit_bias={"7": -100, "12": 3.5},
                  min_tokens=4, max_tokens=8).sampling_params()
    assert params.logit_bias == {7: -100.0, 12: 3.5} and params.min_tokens == 4
    for bias in ({"x7": 1}, {"-1": 1}):
        with pytest.raises(InvalidRequestError) as err:
            body(CompletionRequest, prompt="hi", logit_bias=bias).sampling_params()
        assert err.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        body(CompletionRequest, prompt="hi", min_tokens=9, max_tokens=8).sampling_params()
    assert err.value.field == "min_tokens"


@pytest.mark.parametrize("constraint", [
    {"json": '{"type": "objectx"}'}, {"regex": "(ab"}, {"grammar": "root ::= x"},
    {"json": "[1, 2]"}, {"json": "{not json"}])
def test_a_constraint_that_cannot_compile_names_its_field(constraint):
    from pdserve.engine.sampling_params import StructuredOutputsParams
    from pdserve.engine.structured_outputs import check
    with pytest.raises(InvalidRequestError) as err:
        check(StructuredOutputsParams(**constraint), "response_format")
    assert err.value.field == "response_format" and "cannot be compiled" in err.value.message


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]


def test_tools_reach_the_template_and_forced_choices_become_constraints():
    auto = body(ChatRequest, messages=CHAT, tools=TOOLS)
    assert auto.resolved_tool_choice == "auto" and auto.sampling_params().structured_outputs is None
    assert auto.template_tools()[0]["function"]["name"] == "get_weather"
    named = body(ChatRequest, messages=CHAT, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.sampling_params().structured_outputs.json) == \
        TOOLS[0]["function"]["parameters"]
    assert named.constraint()[1] == "tool_choice"
    required = body(ChatRequest, messages=CHAT, tools=TOOLS, tool_choice="required")
    schema = json.loads(required.sampling_params().structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    one = body(ChatRequest, messages=CHAT, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False)
    assert json.loads(one.sampling_params().structured_outputs.json)["maxItems"] == 1
    for fields, field in [({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                           "tool_choice"),
                          ({"tool_choice": "required", "response_format": {
                              "type": "json_object"}}, "tool_choice")]:
        with pytest.raises(InvalidRequestError) as err:
            body(ChatRequest, messages=CHAT, tools=TOOLS, **fields).sampling_params()
        assert err.value.field == field
    with pytest.raises(InvalidRequestError) as err:
        body(ChatRequest, messages=CHAT, tool_choice="required").sampling_params()
    assert err.value.field == "tool_choice"


def test_a_tool_conversation_round_trips_to_the_template():
    chat = body(ChatRequest, tools=TOOLS, messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}])
    messages = chat.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"
    for bad in ([{"role": "tool", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(InvalidRequestError) as err:
            body(ChatRequest, messages=bad).template_messages()
        assert err.value.field == "messages"


def test_n_and_best_of_become_the_engines_n():
    assert CompletionRequest(prompt="hi", n=3).sampling_params().n == 3
    best = CompletionRequest(prompt="hi", n=2, best_of=5).sampling_params()
    assert best.n == 5 and best.logprobs  # every choice generated, ranked by logprob
    assert CompletionRequest(prompt="hi", n=2, best_of=2).sampling_params().n == 2
    assert ChatRequest(messages=[{"role": "user", "content": "hi"}], n=4,
                       stream=True).sampling_params().n == 4
    for body in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(InvalidRequestError) as err:
            CompletionRequest(prompt="hi", **body).sampling_params()
        assert err.value.field == "best_of"
