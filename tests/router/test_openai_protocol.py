"""The OpenAI bodies as the HTTP front parses them (router/front/body_parser.py),
without a server: a known field pdserve does not implement yet is refused with a 400
naming it, never dropped; its no-op values pass; chat content comes as a string or
as text parts."""
from __future__ import annotations

import json

import pytest

from pdserve.engine.validation import PromptLimits
from pdserve.router.front.body_parser import parse
from pdserve.router.front.openai_protocol import ChatRequest, CompletionRequest

LIMITS = PromptLimits(max_model_len=4096, max_prompt_chars=1 << 20)
CHAT = [{"role": "user", "content": "hi"}]


def body(model, **fields):
    return parse(model, json.dumps(fields).encode(), LIMITS)


@pytest.mark.parametrize("model, fields, param", [
    (ChatRequest, {"messages": CHAT, "response_format": {"type": "json_object"}},
     "response_format"),
    (ChatRequest, {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    (CompletionRequest, {"prompt": "hi", "response_format": {"type": "json_object"}},
     "response_format"),
    (ChatRequest, {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, "tools"),
    (ChatRequest, {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    (ChatRequest, {"messages": CHAT, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (ChatRequest, {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    (ChatRequest, {"messages": CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    (CompletionRequest, {"prompt": "hi", "guided_regex": "a+"}, "guided_regex"),
    (CompletionRequest, {"prompt": "hi", "guided_choice": ["a", "b"]}, "guided_choice"),
    (CompletionRequest, {"prompt": "hi", "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    (CompletionRequest, {"prompt": "hi", "suffix": "!"}, "suffix"),
    (CompletionRequest, {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
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
                tool_choice="none", functions=[], guided_json=None)
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
