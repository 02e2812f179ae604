"""Request checks shared by the engine and the router, so both refuse the same input
with the same field-named error before any state changes."""
from __future__ import annotations

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.tokenizer import Tokenizer


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
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                "prompt", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    return list(prompt)


def check_length(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"{num_prompt} prompt tokens leave no room in the model's "
            f"context of {max_model_len} tokens")
    if num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the model's context of {max_model_len} tokens")
