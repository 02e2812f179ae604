"""Tool calling in the Hermes format (router/front/tool_calls.py), without a server:
the request models and their checks, the constraint a forced choice compiles to, and
model output read back as OpenAI tool calls, whole and streamed in every split."""
from __future__ import annotations

import itertools
import json
import random
import re

import jsonschema_rs
import pytest
import xgrammar
import xgrammar.testing
from pydantic import TypeAdapter, ValidationError

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.front.tool_calls import (
    ConstrainedStreamParser,
    FunctionDefinition,
    HermesStreamParser,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallIn,
    ToolChoice,
    calls_from_constrained,
    check_tools,
    constraint_for,
    new_call_id,
    parse_hermes,
    parse_tool_calls,
    resolve_tool_choice,
    stream_parser,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"},
                                           "limit": {"type": "integer", "minimum": 1}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [Tool.model_validate({"type": "function", "function": {
             "name": "get_weather", "description": "weather now", "parameters": WEATHER}}),
         Tool.model_validate({"type": "function", "function": {
             "name": "search", "parameters": SEARCH, "strict": True}}),
         Tool.model_validate({"type": "function", "function": {"name": "now"}})]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def schema_of(choice) -> str:
    params = constraint_for(TOOLS, choice)
    assert params.kind == "json" and params.disable_any_whitespace
    return params.json


def xgrammar_accepts(schema: str, text: str) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return xgrammar.testing._is_grammar_accept_string(grammar, text)


# --- request models and checks ---------------------------------------------------

@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "dots.are.out"])
def test_function_name_follows_openai_pattern(name):
    with pytest.raises(ValidationError):
        FunctionDefinition.model_validate({"name": name})
    FunctionDefinition.model_validate({"name": "ok_Name-1" + "x" * 55})


def test_tool_choice_takes_the_three_modes_or_a_named_function():
    adapter = TypeAdapter(ToolChoice)
    assert adapter.validate_python("required") == "required"
    assert adapter.validate_python({"type": "function", "function": {"name": "f"}}) == named("f")
    for bad in ("maybe", {"type": "function"}, {"type": "tool", "function": {"name": "f"}}):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)


def test_tool_call_in_takes_arguments_as_text_and_gives_the_template_an_object():
    call = ToolCallIn.model_validate({"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}})
    assert call.template_form()["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(ValidationError):  # strict: arguments are JSON text, not an object
        ToolCallIn.model_validate({"id": "c", "type": "function", "function": {
            "name": "f", "arguments": {"city": "Paris"}}})


def test_openai_default_choice():
    assert resolve_tool_choice(TOOLS, None) == "auto"
    assert resolve_tool_choice(None, None) == resolve_tool_choice([], None) == "none"
    assert resolve_tool_choice(TOOLS, "none") == "none"


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS + TOOLS[:1], None, "tools"),
    (TOOLS, named("delete_everything"), "tool_choice"),
    (None, named("get_weather"), "tool_choice"),
    (None, "required", "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_check_tools_names_the_field_at_fault(tools, choice, field):
    with pytest.raises(InvalidRequestError) as err:
        check_tools(tools, choice)
    assert err.value.field == field


def test_check_tools_returns_the_resolved_choice():
    assert check_tools(TOOLS, None) == "auto"
    assert check_tools(None, None) == "none"
    assert check_tools(TOOLS, named("search")) == named("search")


# --- constraints ----------------------------------------------------------------

def test_auto_and_none_are_unconstrained():
    assert constraint_for(TOOLS, "auto") is constraint_for(TOOLS, "none") is None
    assert constraint_for(None, None) is None


def test_named_choice_constrains_to_that_functions_parameters():
    schema = schema_of(named("search"))
    assert json.loads(schema) == SEARCH
    validator = jsonschema_rs.validator_for(json.loads(schema))
    assert validator.is_valid({"query": "pdserve", "limit": 3})
    assert not validator.is_valid({"query": "pdserve"})
    assert not validator.is_valid({"city": "Paris"})
    assert xgrammar_accepts(schema, '{"query": "pdserve", "limit": 3}')
    assert not xgrammar_accepts(schema, '{"query": "pdserve", "limit": 0}')


def test_named_choice_without_parameters_is_any_object():
    schema = schema_of(named("now"))
    assert json.loads(schema) == {"type": "object", "properties": {}}
    assert xgrammar_accepts(schema, "{}")
    assert not xgrammar_accepts(schema, "[]")


REQUIRED_DOCS = [
    ([{"name": "get_weather", "parameters": {"city": "Paris"}}], True),
    ([{"name": "get_weather", "parameters": {"city": "Paris"}},
      {"name": "search", "parameters": {"query": "q", "limit": 2}},
      {"name": "now", "parameters": {}}], True),
    ([], False),  # minItems 1
    ([{"name": "delete_everything", "parameters": {}}], False),
    ([{"name": "get_weather", "parameters": {"query": "q", "limit": 2}}], False),  # other's args
    ([{"name": "search", "parameters": {"query": "q"}}], False),
    ([{"name": "now"}], False),
    ([{"name": "now", "parameters": {}, "extra": 1}], False),
    ({"name": "now", "parameters": {}}, False),  # an array, even of one
]


@pytest.mark.parametrize("doc, valid", REQUIRED_DOCS)
def test_required_constrains_to_an_array_of_declared_calls(doc, valid):
    schema = schema_of("required")
    assert jsonschema_rs.validator_for(json.loads(schema)).is_valid(doc) is valid
    compact = json.dumps(doc)  # single spaces after ':' and ',', as disable_any_whitespace
    assert xgrammar_accepts(schema, compact) is valid


def test_every_constraint_compiles_with_xgrammar():
    for choice in ("required", *(named(t.function.name) for t in TOOLS)):
        xgrammar.Grammar.from_json_schema(schema_of(choice), any_whitespace=False)


# --- whole output ---------------------------------------------------------------

def test_named_output_is_the_arguments_normalized_when_json():
    [call] = calls_from_constrained('{"city":"Zürich"}', TOOLS, named("get_weather"), ids())
    assert call == ToolCall("call_0", "get_weather", '{"city": "Zürich"}')
    [cut] = calls_from_constrained('{"city": "Zü', TOOLS, named("get_weather"), ids())
    assert cut.arguments == '{"city": "Zü'


def test_required_output_is_one_call_per_element():
    text = json.dumps([{"name": "search", "parameters": {"query": "q", "limit": 2}},
                       {"name": "now", "parameters": {}}])
    calls = calls_from_constrained(text, TOOLS, "required", ids())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"query": "q", "limit": 2}), ("now", {})]
    assert [c.id for c in calls] == ["call_0", "call_1"]
    assert calls_from_constrained(text[:-5], TOOLS, "required") == []
    assert parse_tool_calls(text[:-5], TOOLS, "required") == (text[:-5], [])
    with pytest.raises(ValueError):
        calls_from_constrained(text, TOOLS, "auto")


def block(name, arguments, sep="\n"):
    return f"<tool_call>{sep}{json.dumps({'name': name, 'arguments': arguments})}{sep}</tool_call>"


ONE = block("get_weather", {"city": "Paris"})
TWO = block("search", {"query": "a <b> & </tool>", "limit": 2})


def test_hermes_single_call():
    content, calls = parse_hermes(ONE, ids())
    assert content is None
    assert [c.to_openai() for c in calls] == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_hermes_content_then_several_calls():
    content, calls = parse_hermes(f"Let me look.\n\n{ONE}\n{TWO}\n", ids())
    assert content == "Let me look."
    assert [(c.id, c.name) for c in calls] == [("call_0", "get_weather"), ("call_1", "search")]
    assert json.loads(calls[1].arguments) == {"query": "a <b> & </tool>", "limit": 2}


def test_hermes_arguments_given_as_text_are_kept():
    text = '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    assert parse_hermes(text)[1][0].arguments == "{}"


def test_hermes_without_calls_is_all_content():
    for text in ("plain answer", "", "  spaced  \n", "a <tool> that is no call"):
        assert parse_hermes(text) == (text, [])


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["get_weather", {}]</tool_call>',
    "<tool_call>\n{\"name\": \"get_weather\", \"argu",  # cut off before the body is JSON
])
def test_hermes_malformed_call_leaves_the_whole_text_as_content(bad):
    text = f"Sure. {ONE}{bad}"
    assert parse_hermes(text) == (text, [])


@pytest.mark.parametrize("cut", ["", "\n", "\n</tool", "\n</tool_call"])
def test_hermes_cut_off_call_counts_when_its_body_parses(cut):
    text = f"Hi {ONE}" + ONE[:-len("\n</tool_call>")] + cut
    content, calls = parse_hermes(text, ids())
    assert content == "Hi" and [c.name for c in calls] == ["get_weather"] * 2


def test_dispatch_by_choice():
    assert parse_tool_calls(ONE, TOOLS, "none") == (ONE, [])
    assert parse_tool_calls(ONE, TOOLS, None, ids())[1][0].name == "get_weather"
    assert parse_tool_calls('{"query": "q", "limit": 1}', TOOLS, named("search"),
                            ids()) == (None, [ToolCall("call_0", "search",
                                                       '{"query": "q", "limit": 1}')])
    assert stream_parser(TOOLS, "none") is None
    assert isinstance(stream_parser(TOOLS, None), HermesStreamParser)
    assert isinstance(stream_parser(TOOLS, "required"), ConstrainedStreamParser)


def test_call_ids_are_call_and_24_hex():
    made = {new_call_id() for _ in range(100)}
    assert len(made) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in made)
    assert re.fullmatch(r"call_[0-9a-f]{24}", parse_hermes(ONE)[1][0].id)


# --- streamed output ------------------------------------------------------------

def splits(text, seed):
    """The text as one chunk, char by char, and in random chunks (1 to 8 chars)."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        chunks.append(text[i:i + n])
        i += n
    yield chunks


def stream(parser, chunks):
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    assert all(d.keys() in ({"content"}, {"tool_calls"}) for d in deltas)
    assert all(d.get("content") for d in deltas if "content" in d)  # nothing empty sent
    return deltas


def gathered(deltas):
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    return content, calls


WELL_FORMED = [
    "just an answer, with a < sign and a <tool> tag",
    ONE,
    f"Let me check.\n{ONE}",
    f"Checking both.\n\n{ONE}\n{TWO}\n",
    f"{ONE}{TWO}{block('now', {}, sep='')}",
    f"Hmm <tool_ca and more\n{ONE}",
    f"Cut off: {ONE}\n" + ONE[:-len("</tool_call>")],
    "<tool_call" + "\n",  # an unfinished tag with no call: content
]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_stream_gives_the_same_calls_as_the_whole_output_in_every_split(text):
    content, calls = parse_hermes(text, ids())
    for chunks in splits(text, seed=len(text)):
        parser = HermesStreamParser(ids())
        deltas = stream(parser, chunks)
        streamed_content, streamed_calls = gathered(deltas)
        assert [{"index": i, **c.to_openai()} for i, c in enumerate(calls)] == streamed_calls
        assert streamed_content.strip() == (content or "").strip()
        assert parser.has_calls == bool(calls)
        if calls:  # no piece of a tag is ever sent as content
            assert "<tool_call" not in streamed_content and "</tool" not in streamed_content


@pytest.mark.parametrize("text", WELL_FORMED)
def test_stream_in_every_two_part_split(text):
    want = gathered(stream(HermesStreamParser(ids()), [text]))
    for i in range(len(text) + 1):
        assert gathered(stream(HermesStreamParser(ids()), [text[:i], text[i:]])) == want


def test_stream_sends_content_as_it_comes_holding_back_a_possible_tag():
    parser = HermesStreamParser(ids())
    assert parser.feed("Hello") == [{"content": "Hello"}]
    assert parser.feed(" there\n<tool") == [{"content": " there"}]
    assert parser.feed("box>") == [{"content": "\n<toolbox>"}]
    assert parser.feed("\n") == []
    assert parser.feed(ONE[:20]) == []
    assert parser.feed(ONE[20:]) == [{"tool_calls": [{"index": 0, **parse_hermes(
        ONE, ids())[1][0].to_openai()}]}]
    assert parser.feed("\n  ") == []
    assert parser.finish() == []  # whitespace after the last call is dropped


def test_stream_without_calls_sends_the_text_exactly():
    text = "  two\n\nparagraphs <tool_\n\n"
    for chunks in splits(text, seed=1):
        content, calls = gathered(stream(HermesStreamParser(), chunks))
        assert (content, calls) == (text, [])


def test_stream_sends_a_malformed_block_as_content_and_goes_on():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    for chunks in splits(f"A{bad}{ONE}", seed=2):
        content, calls = gathered(stream(HermesStreamParser(ids()), chunks))
        assert content == "A" + bad
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert calls[0]["index"] == 0


def test_stream_flushes_a_cut_off_call_that_does_not_parse_as_content():
    cut = ONE[:30]
    parser = HermesStreamParser(ids())
    assert parser.feed(f"Ok {cut}") == [{"content": "Ok"}]
    assert parser.finish() == [{"content": cut}]
    assert not parser.has_calls


def test_constrained_stream_named_streams_the_arguments():
    text = '{"city": "Paris", "unit": "C"}'
    for chunks in splits(text, seed=3):
        parser = ConstrainedStreamParser(TOOLS, named("get_weather"), ids())
        deltas = stream(parser, chunks)
        assert deltas[0] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                             "function": {"name": "get_weather",
                                                          "arguments": ""}}]}
        fragments = [d["tool_calls"][0] for d in deltas[1:]]
        assert all(f.keys() == {"index", "function"} and f["index"] == 0 for f in fragments)
        assert "".join(f["function"]["arguments"] for f in fragments) == text
        assert parser.has_calls


def test_constrained_stream_named_with_no_output_still_names_the_call():
    parser = ConstrainedStreamParser(TOOLS, named("now"), ids())
    assert parser.finish()[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": ""}


def test_constrained_stream_required_sends_each_call_whole_at_the_end():
    text = json.dumps([{"name": "now", "parameters": {}},
                       {"name": "get_weather", "parameters": {"city": "Oslo"}}])
    parser = ConstrainedStreamParser(TOOLS, "required", ids())
    assert [d for c in text for d in parser.feed(c)] == [] and not parser.has_calls
    want = calls_from_constrained(text, TOOLS, "required", ids())
    assert parser.finish() == [c.delta(i) for i, c in enumerate(want)]
    assert parser.has_calls
    cut = ConstrainedStreamParser(TOOLS, "required", ids())
    cut.feed(text[:-3])
    assert cut.finish() == [{"content": text[:-3]}] and not cut.has_calls


def test_constrained_stream_refuses_a_choice_that_forces_nothing():
    with pytest.raises(ValueError):
        ConstrainedStreamParser(TOOLS, "auto")
