"""The OpenAI request bodies (/v1/completions, /v1/chat/completions).

Sampling fields are derived from SamplingParams (name, type, default, description):
only those whose OpenAI form differs are declared here, so a new SamplingParams
field reaches HTTP without an edit here."""
from __future__ import annotations

import typing
from dataclasses import fields

from pydantic import BaseModel, ConfigDict, Field, create_model

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import help_of
from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from pdserve.engine.validation import check_text

# SamplingParams fields whose OpenAI spelling differs: nullable max_tokens, stop as a
# string or a list, logprobs as a count (completions) or a flag + top_logprobs (chat).
OPENAI_SHAPED = ("max_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs")
DERIVED = tuple(f.name for f in fields(SamplingParams) if f.name not in OPENAI_SHAPED)


def _derived_fields() -> dict:
    hints = typing.get_type_hints(SamplingParams)
    return {f.name: (hints[f.name], Field(f.default, description=help_of(f)))
            for f in fields(SamplingParams) if f.name in DERIVED}


_SamplingFields = create_model("SamplingFields", __config__=ConfigDict(extra="ignore"),
                               **_derived_fields())


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_SamplingFields):
    # OpenAI fields we do not use are accepted (extra="ignore", inherited).
    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Known fields this server does not implement: refused when set, never ignored.
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0

    def _params(self, max_tokens: int | None, logprobs: bool,
                top_logprobs: int) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError("n", "only n=1 is supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of", "only best_of=1 is supported")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "logit_bias is not supported")
        if self.min_tokens:
            raise InvalidRequestError("min_tokens", "min_tokens is not supported")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=SamplingParams.max_tokens if max_tokens is None else max_tokens,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=logprobs, top_logprobs=top_logprobs,
            **{name: getattr(self, name) for name in DERIVED})


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None  # the chosen token's and this many top logprobs
    echo: bool = False

    def sampling_params(self) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def template_messages(self) -> list[dict]:
        """The messages as the chat template takes them, checked."""
        if not self.messages:
            raise InvalidRequestError("messages", "must not be empty")
        for i, message in enumerate(self.messages):
            check_text(f"messages[{i}].content", message.content)
            check_text(f"messages[{i}].role", message.role)
        return [m.model_dump() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs=true")
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        return self._params(max_tokens, self.logprobs, self.top_logprobs or 0)
