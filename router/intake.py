"""A request's way in: validation and tokenization, before anything is placed.
Raises InvalidRequestError naming the field (400 / INVALID_ARGUMENT)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import uuid

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import PromptLimits, check_length, prompt_token_ids
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
                     owner: str = "", slo: Slo = Slo()) -> Accepted:
        """Text that cannot fit the context is refused before tokenizing, and long text
        is tokenized off the event loop, which serves every other request meanwhile."""
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
                          slo: Slo = Slo()) -> Accepted:
        """The chat template applied to checked messages, then as accept()."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this router has no tokenizer")
        chars = sum(len(m["content"]) for m in messages)
        self.limits.check_chars("messages", chars)
        ids = await self._tokenize(chars, self._chat_token_ids, messages)
        return self._accepted(ids, params, request_id, owner, slo)

    def _chat_token_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.render_chat(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template has them

    async def _tokenize(self, chars: int, fn, *args) -> list[int]:
        if chars <= _INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _accepted(self, ids: list[int], params: SamplingParams, request_id: str,
                  owner: str, slo: Slo) -> Accepted:
        check_length(len(ids), params.max_tokens, self.model.max_model_len)
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
