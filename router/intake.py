"""A request's way in: validation and tokenization, before anything is placed.
Raises InvalidRequestError naming the field (400 / INVALID_ARGUMENT)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import uuid

from pdserve.engine import structured_outputs
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import PromptLimits, check_length, check_vocab, prompt_token_ids
from pdserve.router.clock import Clock
from pdserve.router.lifecycle import Accepted
from pdserve.router.model_info import ModelInfo
from pdserve.router.slo import Slo

# Text up to this long is tokenized on the event loop (well under a millisecond);
# longer text in a thread.
_INLINE_TOKENIZE_CHARS = 16384
# A client-chosen request id names the request in logs and aborts: an id, not a payload.
MAX_REQUEST_ID_CHARS = 256


class Intake:
    def __init__(self, tokenizer: Tokenizer | None, model: ModelInfo, default_slo: Slo,
                 clock: Clock):
        """tokenizer None: prompts are token ids (the simulator serves no text)."""
        self.tokenizer, self.model, self.default_slo, self.clock = (
            tokenizer, model, default_slo, clock)
        self._ids = itertools.count()

    @functools.cached_property
    def limits(self) -> PromptLimits:
        chars = self.tokenizer.max_token_chars if self.tokenizer is not None else 0
        return PromptLimits(self.model.max_model_len, self.model.max_model_len * chars)

    async def accept(self, prompt, params: SamplingParams, request_id: str = "",
                     owner: str = "", slo: Slo = Slo(),
                     constraint_field: str = "structured_outputs") -> Accepted:
        """Text that cannot fit the context is refused before tokenizing, and long text
        is tokenized off the event loop, which serves every other request meanwhile.
        constraint_field: where the request's structured-output constraint came from
        (response_format, say), named by the 400 when it cannot be compiled."""
        await self._check_constraint(params, constraint_field)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "must be token ids: this router has no "
                                          "tokenizer")
            self.limits.check_chars("prompt", len(prompt))
        elif isinstance(prompt, (list, tuple)):
            self.limits.check_ids("prompt", len(prompt))
        ids = await self._tokenize(len(prompt) if isinstance(prompt, str) else 0,
                                   prompt_token_ids, prompt, self.tokenizer,
                                   self.model.vocab_size)
        return self._accepted(ids, params, request_id, owner, slo)

    async def accept_chat(self, messages: list[dict], params: SamplingParams,
                          request_id: str = "", owner: str = "",
                          slo: Slo = Slo(),
                          constraint_field: str = "structured_outputs",
                          tools: list[dict] | None = None) -> Accepted:
        """The chat template applied to checked messages (and the tools the model may
        call, HF's `tools`), then as accept()."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this router has no tokenizer")
        await self._check_constraint(params, constraint_field)
        chars = sum(len(m["content"]) for m in messages)
        self.limits.check_chars("messages", chars)
        ids = await self._tokenize(chars, self._chat_token_ids, messages, tools)
        return self._accepted(ids, params, request_id, owner, slo)

    def _chat_token_ids(self, messages: list[dict], tools: list[dict] | None = None,
                        add_special_tokens: bool = False,
                        add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.render_chat(messages, tools, add_generation_prompt)
        # The template writes the special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       tools: list[dict] | None = None, add_special_tokens: bool | None = None,
                       add_generation_prompt: bool = True) -> list[int]:
        """vLLM's /tokenize: the token ids a prompt (or chat messages, through the
        template) becomes, as a request's would."""
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this router has no tokenizer")
        if prompt is not None:
            return await self._tokenize(len(prompt), self.tokenizer.encode, prompt,
                                        True if add_special_tokens is None else add_special_tokens)
        chars = sum(len(m["content"]) for m in messages)
        return await self._tokenize(chars, self._chat_token_ids, messages, tools,
                                    bool(add_special_tokens), add_generation_prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        """vLLM's /detokenize (special tokens kept, as vLLM's)."""
        if self.tokenizer is None:
            raise InvalidRequestError("tokens", "this router has no tokenizer")
        beyond = [t for t in token_ids if t >= self.model.vocab_size]
        if beyond:
            raise InvalidRequestError("tokens", f"token id {beyond[0]} is beyond the "
                                      f"vocabulary of {self.model.vocab_size}")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def _check_constraint(self, params: SamplingParams, field: str) -> None:
        """A structured-output constraint that cannot compile is a 400 before placing
        (in a thread: xgrammar's first import and a large schema take a while)."""
        if params.structured_outputs is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, structured_outputs.check, params.structured_outputs, field)

    async def _tokenize(self, chars: int, fn, *args) -> list[int]:
        if chars <= _INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _accepted(self, ids: list[int], params: SamplingParams, request_id: str,
                  owner: str, slo: Slo) -> Accepted:
        check_length(len(ids), params.max_tokens, self.model.max_model_len)
        check_vocab(params, self.model.vocab_size)
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} "
                                      "characters")
        if not request_id.isprintable():  # and so never a moved request's (Flight.key)
            raise InvalidRequestError("request_id", "must be printable text (no control "
                                      "characters)")
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        return Accepted(request_id=rid, prompt_token_ids=ids, params=params,
                        arrival_time=self.clock.time(), owner=owner,
                        slo=slo.over(self.default_slo))
