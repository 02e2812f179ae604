"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) and the error
body every failure answers with.

Sampling fields are derived from SamplingParams (name, type, default, description,
range): only those whose OpenAI form differs are declared here, so a new
SamplingParams field reaches HTTP without an edit here. Every rule a schema can state
is stated here, so the OpenAPI document says what the server accepts; the rest (a
prompt's tokens within the vocabulary, prompt plus max_tokens within the context) is
checked by the engine's validation and documented by the front end."""
from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Annotated, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import bounds_of, help_of
from pdserve.engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from pdserve.engine.validation import PromptLimits, check_text
from pdserve.router.slo import MAX_SLO_MS, Slo, parse_ms

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"

# SamplingParams fields whose OpenAI spelling differs: nullable max_tokens, stop as a
# string or a list, logprobs as a count (completions) or a flag + top_logprobs (chat).
OPENAI_SHAPED = ("max_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs")
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
    return {f.name: (_json_type(hints[f.name]),
                     Field(f.default, description=help_of(f), **bounds_of(f)))
            for f in fields(SamplingParams) if f.name in DERIVED}


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


class ResponseFormatText(BaseModel):
    """The one response_format served yet: plain text (json_object and json_schema,
    structured outputs, are refused with a 400 rather than ignored)."""
    model_config = ConfigDict(strict=True)
    type: Literal["text"]


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
    # Known fields this server does not implement: only their no-op values pass.
    n: JsonInt = Field(1, ge=1, le=1, description="only 1 is supported")
    best_of: json_int(ge=1, le=1) | None = Field(
        None, description="only 1 is supported")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(
        None, description="not supported: only an empty map")
    min_tokens: JsonInt = Field(0, ge=0, le=0, description="not supported: only 0")
    response_format: ResponseFormatText | None = Field(
        None, description='only {"type": "text"}: structured outputs (json_object, '
        'json_schema) are not supported yet')
    # vLLM's structured-output extras: refused, never ignored.
    structured_outputs: None = unsupported("structured outputs")
    guided_json: None = unsupported("structured outputs")
    guided_regex: None = unsupported("structured outputs")
    guided_choice: None = unsupported("structured outputs")
    guided_grammar: None = unsupported("structured outputs")
    # pdserve's: the request's SLOs (over the headers x-slo-ttft-ms / x-slo-tpot-ms).
    slo_ttft_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-to-first-token SLO in ms; unset: the x-slo-ttft-ms header, else the "
        "server's default, else best effort"))
    slo_tpot_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-per-output-token SLO in ms; unset: the x-slo-tpot-ms header, else the "
        "server's default, else best effort"))

    def slo(self, headers) -> Slo:
        """The body's SLOs, else the headers' (each named as the client spelled it)."""
        header = Slo.from_ms(parse_ms(headers.get(SLO_TTFT_HEADER), SLO_TTFT_HEADER),
                             parse_ms(headers.get(SLO_TPOT_HEADER), SLO_TPOT_HEADER),
                             ttft_field=SLO_TTFT_HEADER, tpot_field=SLO_TPOT_HEADER)
        return Slo.from_ms(self.slo_ttft_ms, self.slo_tpot_ms).over(header)

    def _params(self, max_tokens: int | None, logprobs: bool,
                top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=SamplingParams.max_tokens if max_tokens is None else max_tokens,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=logprobs, top_logprobs=top_logprobs,
            **{name: getattr(self, name) for name in DERIVED})


class CompletionRequest(_Sampling):
    prompt: (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]) = Field(
        description="text, token ids, or a list of one text (batched prompts are not "
        "supported)")
    logprobs: TopLogprobs | None = Field(
        None, description="the chosen token's logprob and this many top logprobs")
    echo: Literal[False] = Field(False, description="not supported: only false")
    suffix: None = unsupported("suffix")
    prompt_logprobs: None = unsupported("prompt logprobs")

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0)

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
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="text, or a list of text parts (joined by newlines, as vLLM joins "
        "them)")

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # Tool calling is not served yet: no tools, or tool_choice "none", only.
    tools: Annotated[list[dict], Field(max_length=0)] | None = Field(
        None, description="not supported yet: tool calling; only an empty list")
    tool_choice: Literal["none"] | None = Field(
        None, description='not supported yet: tool calling; only "none"')
    functions: Annotated[list[dict], Field(max_length=0)] | None = Field(
        None, description="not supported yet (deprecated tool calling); only an empty list")
    function_call: Literal["none"] | None = Field(
        None, description='not supported yet (deprecated tool calling); only "none"')

    def check_size(self, limits: PromptLimits) -> None:
        limits.check_chars("messages", sum(len(m.text) for m in self.messages))

    def template_messages(self) -> list[dict]:
        """The messages as the chat template takes them (content parts joined),
        checked."""
        for i, message in enumerate(self.messages):
            check_text(f"messages[{i}].content", message.text)
            check_text(f"messages[{i}].role", message.role)
        return [{"role": m.role, "content": m.text} for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs=true")
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        return self._params(max_tokens, self.logprobs, self.top_logprobs or 0)
