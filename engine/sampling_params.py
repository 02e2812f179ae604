"""Per-request sampling settings (vLLM's names and defaults)."""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, fields

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import bounds_of, bounds_text, option, within

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-45
# overflow float32 and would put inf / NaN into the whole batch's sampling.
SAMPLING_EPS = 1e-5
# Stop conditions are checked every step and the longest stop string is held back
# from streaming, so both are bounded.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 1024, 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = option(16, "the most tokens to generate", ge=1)
    temperature: float = option(1.0, "0 (or below 1e-5) = greedy", ge=0)
    top_k: int = option(0, "sample from the k most likely tokens; 0 (or -1) = off", ge=-1)
    top_p: float = option(1.0, "sample from the smallest set of tokens whose probability "
                          "reaches top_p", gt=0, le=1)
    min_p: float = option(0.0, "drop tokens below min_p x the top token's probability",
                          ge=0, le=1)
    presence_penalty: float = option(0.0, "minus this for every token already in the "
                                     "output", ge=-2, le=2)
    frequency_penalty: float = option(0.0, "minus this times the token's count in the "
                                      "output", ge=-2, le=2)
    repetition_penalty: float = option(1.0, "HF-style, over prompt and output tokens; "
                                       "1 = off", gt=0)
    seed: int | None = option(None, "seeds this request's sampling; the k-th token is "
                              "drawn from (seed, k) wherever it is sampled")
    stop: tuple[str, ...] = option((), "strings that end the output (not included)")
    stop_token_ids: tuple[int, ...] = option((), "token ids that end the output")
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    logprobs: bool = option(False, "return the logprob of each chosen token")
    top_logprobs: int = option(0, "and of this many most likely tokens at each position",
                               ge=0, le=MAX_TOP_LOGPROBS)
    priority: int = option(0, "lower runs first under the `priority` scheduling policy")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_bounds(self)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _require(self.seed is None or _is_int(self.seed), "seed",
                 f"must be an integer, got {self.seed!r}")
        _require(all(isinstance(s, str) and s and _is_unicode(s) for s in self.stop), "stop",
                 "must be non-empty, valid Unicode strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS
                 and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
                 f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        _require(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids",
                 "must be integers")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS}")
        _require(_is_int(self.priority), "priority", "must be an integer")
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _check_bounds(params: SamplingParams) -> None:
    """Every bounded field: the right kind of number, within its range."""
    for name, integer, bounds in _bounded():
        value = getattr(params, name)
        kind = _is_int(value) if integer else _is_number(value)
        _require(kind and within(value, bounds), name,
                 f"must be {'an integer' if integer else 'a number'} {bounds_text(bounds)}, "
                 f"got {value!r}")


@functools.cache
def _bounded() -> tuple[tuple[str, bool, dict], ...]:
    hints = typing.get_type_hints(SamplingParams)
    return tuple((f.name, hints[f.name] is int, bounds_of(f))
                 for f in fields(SamplingParams) if bounds_of(f))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")  # JSON escapes can carry lone surrogates
    except UnicodeEncodeError:
        return False
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
