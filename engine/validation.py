"""Request checks shared by the engine and the router, so both refuse the same input
with the same field-named error before any state changes."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_manager import blocks_for
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptLimits:
    """What can fit the context, checked from sizes alone, before any per-token or
    per-character work (a 4 MB body must not cost a tokenizer pass to refuse)."""
    max_model_len: int
    max_prompt_chars: int  # longer text cannot fit, whatever it tokenizes to

    def check_chars(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(field, f"{chars} characters cannot fit the model's "
                                      f"context of {self.max_model_len} tokens")

    def check_ids(self, field: str, count: int) -> None:
        if count >= self.max_model_len:
            raise InvalidRequestError(field, _no_room(count, self.max_model_len))


def check_text(field: str, text: str) -> None:
    """Text must be encodable as UTF-8: JSON's escapes can carry lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(field, f"is not valid Unicode text ({err.reason} at "
                                  f"position {err.start})") from None


def prompt_token_ids(prompt, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        check_text("prompt", prompt)
        return tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise InvalidRequestError("prompt", "must be a non-empty string or list of token ids")
    # Whole-list checks (C loops): a long prompt is checked in microseconds.
    if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt
                   if type(t) is not int or not 0 <= t < vocab_size)
        raise InvalidRequestError(
            "prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    return list(prompt)


def check_length(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt >= max_model_len:
        raise InvalidRequestError("prompt", _no_room(num_prompt, max_model_len))
    if num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the model's context of {max_model_len} tokens")


def check_fits(num_prompt: int, max_tokens: int, num_outputs: int, max_model_len: int,
               num_blocks: int, block_size: int) -> None:
    """A request's sizes, checked alike by every worker (the engine's, and the
    simulator's): the prompt and max_tokens against the context and the whole KV
    cache, and a moved request's outputs so far against max_tokens."""
    check_length(num_prompt, max_tokens, max_model_len)
    need = blocks_for(num_prompt + max_tokens, block_size)
    if need > num_blocks:
        raise InvalidRequestError("max_tokens", f"prompt plus max_tokens needs {need} KV "
                                  f"blocks; the cache holds {num_blocks}")
    if num_outputs >= max_tokens:
        raise InvalidRequestError("output_token_ids", f"{num_outputs} tokens generated "
                                  f"already: max_tokens {max_tokens} leaves none")


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's sampling names (logit_bias' keys) within the
    vocabulary: the router checks before placing it, every engine again."""
    if params.logit_bias:
        beyond = [t for t in params.logit_bias if t >= vocab_size]
        if beyond:
            raise InvalidRequestError("logit_bias", f"token id {beyond[0]} is beyond the "
                                      f"vocabulary of {vocab_size}")


def _no_room(num_prompt: int, max_model_len: int) -> str:
    return (f"{num_prompt} prompt tokens leave no room in the model's context of "
            f"{max_model_len} tokens")
