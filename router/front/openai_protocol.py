"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) and the error
body every failure answers with.

Sampling fields are derived from SamplingParams (name, type, default, description,
range): only those whose OpenAI form differs are declared here, so a new
SamplingParams field reaches HTTP without an edit here. Every rule a schema can state
is stated here, so the OpenAPI document says what the server accepts; the rest (a
prompt's tokens within the vocabulary, prompt plus max_tokens within the context) is
checked by the engine's validation and documented by the front end."""
from __future__ import annotations

import json
import types
import typing
from dataclasses import fields, replace
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, create_model

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import bounds_of, help_of
from pdserve.engine.sampling_params import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from pdserve.engine.validation import PromptLimits, check_text
from pdserve.router.front.tool_calls import (
    Tool,
    ToolCallIn,
    ToolChoice,
    check_tools,
    constraint_for,
)
from pdserve.router.slo import MAX_SLO_MS, Slo, parse_ms

MAX_TOOLS = 128  # tools a request may declare (each is rendered into the prompt)
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"

# SamplingParams fields whose OpenAI spelling differs: nullable max_tokens, stop as a
# string or a list, logprobs as a count (completions) or a flag + top_logprobs (chat).
# logit_bias keyed by token ids as strings (JSON's keys), structured outputs from
# response_format, vLLM's structured_outputs or its older guided_* fields.
OPENAI_SHAPED = ("max_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs",
                 "logit_bias", "structured_outputs")
DERIVED = tuple(f.name for f in fields(SamplingParams) if f.name not in OPENAI_SHAPED)


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(ge: int | None = None, le: int | None = None):
    """JSON Schema's integer: 3 and 3.0, never true or "3" (the models are strict)."""
    bounds = [b for b in (ge is not None and Ge(ge), le is not None and Le(le)) if b]
    return Annotated[(int, *bounds, BeforeValidator(_integral))]


JsonInt = json_int()


def _json_type(hint):
    if hint is int:
        return JsonInt
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.Union[tuple(_json_type(h) for h in typing.get_args(hint))]
    return hint


def _derived_fields() -> dict:
    hints = typing.get_type_hints(SamplingParams)
    out = {}
    for f in fields(SamplingParams):
        if f.name not in DERIVED:
            continue
        hint, bounds = _json_type(hints[f.name]), bounds_of(f)
        if bounds and type(None) in typing.get_args(hints[f.name]):  # on the number, so
            number = next(h for h in typing.get_args(hints[f.name]) if h is not type(None))
            hint = (json_int(**bounds) if number is int else Annotated[(number, *(
                {"ge": Ge, "gt": Gt, "le": Le}[k](v) for k, v in bounds.items()))]) | None
            bounds = {}  # the document states them (null has none)
        out[f.name] = (hint, Field(f.default, description=help_of(f), **bounds))
    return out


_SamplingFields = create_model("SamplingFields",
                               __config__=ConfigDict(extra="ignore", strict=True),
                               **_derived_fields())


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, rate_limit_error, server_error, ...
    param: str | None = None  # the offending field, where there is one
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body, OpenAI's shape."""
    error: ErrorDetail


NonEmpty = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = json_int(ge=0)
MaxTokens = json_int(ge=1)
TopLogprobs = json_int(ge=0, le=MAX_TOP_LOGPROBS)


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: OpenAI's name, description, schema and strict
    (the schema is always enforced: strict or not, the output validates)."""
    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; "
                                 "absent: any JSON object")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (unconstrained), json_object (one JSON object)
    or json_schema (output valid against the schema)."""
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams.from_response_format(
            self.model_dump(by_alias=True, exclude_none=True))


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), json_object, regex,
    choice or grammar (EBNF, xgrammar's GBNF-style dialect)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict | GrammarText | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                      Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: GrammarText | None = None
    disable_any_whitespace: bool = Field(True, description=(
        "JSON without free whitespace (vLLM defaults this off; a small model then pads "
        "with whitespace)"))

    def params(self) -> StructuredOutputsParams:
        schema = self.json_
        return StructuredOutputsParams(
            json=json.dumps(schema) if isinstance(schema, dict) else schema,
            json_object=bool(self.json_object), regex=self.regex,
            choice=tuple(self.choice) if self.choice else None, grammar=self.grammar,
            disable_any_whitespace=self.disable_any_whitespace)


def unsupported(what: str):
    """A known OpenAI (or vLLM) field this server does not implement: only its absence
    (or null) passes, so a request relying on it gets a 400 naming it instead of an
    answer that silently ignored it."""
    return Field(None, description=f"not supported yet: {what}; only null")


class _Sampling(_SamplingFields):
    # OpenAI fields we do not use are accepted (extra="ignore", inherited).
    model: str | None = None
    max_tokens: MaxTokens | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] \
        | None = None
    stop_token_ids: Annotated[list[JsonInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    best_of: json_int(ge=1, le=MAX_N) | None = Field(
        None, description="generate this many choices (at least n, from one prefill) and "
        "answer the n with the highest logprob per token; not with stream")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS,
                                                           le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = Field(
        None, description=f"token id (as a string) -> a bias in [-{MAX_LOGIT_BIAS:g}, "
        f"{MAX_LOGIT_BIAS:g}] added to its logit before sampling")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (one JSON object) or json_schema (valid "
        "against the schema): the tokens that would break it are masked")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's structured outputs: json, json_object, regex, choice "
        "or grammar")
    # vLLM's older spellings of structured_outputs.
    guided_json: dict | GrammarText | None = Field(None, description="as "
                                                   "structured_outputs.json")
    guided_regex: GrammarText | None = Field(None, description="as structured_outputs.regex")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                             Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="as structured_outputs.choice")
    guided_grammar: GrammarText | None = Field(None, description="as "
                                               "structured_outputs.grammar")
    # pdserve's: the request's SLOs (over the headers x-slo-ttft-ms / x-slo-tpot-ms).
    slo_ttft_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-to-first-token SLO in ms; unset: the x-slo-ttft-ms header, else the "
        "server's default, else best effort"))
    slo_tpot_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-per-output-token SLO in ms; unset: the x-slo-tpot-ms header, else the "
        "server's default, else best effort"))
    _constraint: tuple | None = PrivateAttr(None)  # constraint()'s, once built

    def slo(self, headers) -> Slo:
        """The body's SLOs, else the headers' (each named as the client spelled it)."""
        header = Slo.from_ms(parse_ms(headers.get(SLO_TTFT_HEADER), SLO_TTFT_HEADER),
                             parse_ms(headers.get(SLO_TPOT_HEADER), SLO_TPOT_HEADER),
                             ttft_field=SLO_TTFT_HEADER, tpot_field=SLO_TPOT_HEADER)
        return Slo.from_ms(self.slo_ttft_ms, self.slo_tpot_ms).over(header)

    def _params(self, max_tokens: int | None, logprobs: bool,
                top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        given = dict(
            max_tokens=SamplingParams.max_tokens if max_tokens is None else max_tokens,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=self.logit_bias,
            structured_outputs=self.constraint()[0],
            **{name: getattr(self, name) for name in DERIVED})
        return SamplingParams(**(given | self._best_of()))

    def _best_of(self) -> dict:
        """best_of > n: that many choices, their logprobs kept to rank them by."""
        if self.best_of is None or self.best_of == self.n:
            return {}
        if self.best_of < self.n:
            raise InvalidRequestError("best_of", f"must be at least n ({self.n}), got "
                                      f"{self.best_of}")
        if self.stream:
            raise InvalidRequestError("best_of", "cannot be streamed when it exceeds n "
                                      "(the best choices are known at the end)")
        return {"n": self.best_of, "logprobs": True}

    def constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """The structured-output constraint and the field it came from (errors name
        it), built once per request (its sampling parameters and its error's field
        both ask)."""
        if self._constraint is None:
            self._constraint = self._find_constraint()
        return self._constraint

    def _find_constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """At most one of response_format, structured_outputs and guided_*."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", self.response_format.params))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.params))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, lambda kind=kind, value=value: StructuredOutputs(
                    **{kind: value}).params()))
        if len(given) > 1:
            raise InvalidRequestError(given[1][0], f"only one constraint per request: "
                                      f"{given[0][0]} is set already")
        if not given:
            return None, "structured_outputs"
        field, build = given[0]
        try:
            return build(), field
        except InvalidRequestError as err:
            raise InvalidRequestError(field, err.message) from None


class CompletionRequest(_Sampling):
    prompt: (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]) = Field(
        description="text, token ids, or a list of one text (batched prompts are not "
        "supported)")
    logprobs: TopLogprobs | None = Field(
        None, description="the chosen token's logprob and this many top logprobs")
    echo: bool = Field(False, description="the prompt before the completion in text, "
                       "and with logprobs, its tokens' logprobs first (the first is null)")
    suffix: None = unsupported("suffix")

    def sampling_params(self) -> SamplingParams:
        params = self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            return replace(params, prompt_logprobs=self.logprobs)
        return params

    def check_size(self, limits: PromptLimits) -> None:
        """Refuses a prompt that cannot fit the context, from its size alone."""
        prompt = self.prompt_input()
        if isinstance(prompt, str):
            limits.check_chars("prompt", len(prompt))
        else:
            limits.check_ids("prompt", len(prompt))

    def prompt_input(self) -> str | list[int]:
        """The one prompt: a list of one text is that text."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    """A chat message's content part: text (other parts, images, are refused)."""
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        None, description="text, or a list of text parts (joined by newlines, as vLLM "
        "joins them); only an assistant message with tool_calls may leave it out")
    tool_calls: list[ToolCallIn] | None = Field(
        None, description="an assistant message's tool calls, as this API answered them")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it "
                                     "answers")
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    @property
    def num_chars(self) -> int:
        return len(self.text) + sum(len(c.function.arguments) + len(c.function.name)
                                    for c in self.tool_calls or ())


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (content parts joined; an
    assistant's tool calls with their arguments as objects, as vLLM passes them),
    checked."""
    out = []
    for i, message in enumerate(messages):
        check_text(f"messages[{i}].content", message.text)
        if message.content is None and not (message.role == "assistant"
                                            and message.tool_calls):
            raise InvalidRequestError("messages", f"messages[{i}] has no content")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequestError("messages", f"messages[{i}] (a tool result) needs "
                                      "tool_call_id")
        item = {"role": message.role, "content": message.text}
        if message.tool_calls:
            item["tool_calls"] = [call.template_form() for call in message.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        out.append(item)
    return out


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as HF's `tools` argument passes them to the chat template."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call: rendered through the chat "
        "template's `tools`, calls parsed from its output (Hermes <tool_call> blocks)")
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required" (one or '
        "more calls, held to the tools' schemas) or a named function (its arguments held "
        "to its schema)")
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call in the answer (the first; \"required\" "
        "held to one)")
    functions: Annotated[list[dict], Field(max_length=0)] | None = Field(
        None, description="not supported (deprecated tool calling: use tools); only an "
        "empty list")
    function_call: Literal["none"] | None = Field(
        None, description='not supported (deprecated tool calling: use tool_choice); only '
        '"none"')

    def check_size(self, limits: PromptLimits) -> None:
        limits.check_chars("messages", sum(m.num_chars for m in self.messages))
        if self.tools:
            limits.check_chars("tools", len(json.dumps(self.template_tools())))

    @property
    def resolved_tool_choice(self) -> ToolChoice:
        """The tool choice, OpenAI's default filled in, checked against the tools."""
        return check_tools(self.tools, self.tool_choice)

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    def _find_constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """A forced tool choice (named, or "required") holds the output to the tools'
        schemas: it cannot be combined with another constraint."""
        tool = constraint_for(self.tools, self.resolved_tool_choice)
        if tool is not None and self.parallel_tool_calls is False \
                and self.resolved_tool_choice == "required":
            tool = StructuredOutputsParams(json=json.dumps({**json.loads(tool.json),
                                                            "maxItems": 1}))
        constraint, field = super()._find_constraint()
        if tool is None:
            return constraint, field
        if constraint is not None:
            raise InvalidRequestError("tool_choice", f"a forced tool call cannot be "
                                      f"combined with {field}")
        return tool, "tool_choice"

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs=true")
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        return self._params(max_tokens, self.logprobs, self.top_logprobs or 0)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(strict=True)
    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize (or messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered through the chat template")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="the tokenizer's special tokens (bos); unset: true for a "
        "prompt, false for messages (the template writes them)")
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_size(self, limits: PromptLimits) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "set prompt or messages, not both")
        if self.prompt is not None:
            check_text("prompt", self.prompt)
            limits.check_chars("prompt", len(self.prompt))
        else:
            limits.check_chars("messages", sum(m.num_chars for m in self.messages))


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""
    model_config = ConfigDict(strict=True)
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(min_length=1)]

    def check_size(self, limits: PromptLimits) -> None:
        limits.check_ids("tokens", len(self.tokens))
