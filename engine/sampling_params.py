"""Per-request sampling settings (vLLM's names and defaults)."""
from __future__ import annotations

import functools
import json
import math
import typing
from dataclasses import dataclass, fields, replace

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import bounds_of, bounds_text, option, within

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-45
# overflow float32 and would put inf / NaN into the whole batch's sampling.
SAMPLING_EPS = 1e-5
# Stop conditions are checked every step and the longest stop string is held back
# from streaming, so both are bounded.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 1024, 1024
# OpenAI's range for a logit bias, and vLLM's bound on how many a request may carry
# (each is applied every step).
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES = 100.0, 1024
# A grammar or schema is compiled once per worker (cached): its text is bounded.
MAX_GRAMMAR_CHARS, MAX_CHOICES = 64 << 10, 256
# The most output sequences one request may ask for (OpenAI's bound on n).
MAX_N = 128
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output (vLLM's StructuredOutputsParams): exactly one of
    a JSON schema, any JSON object, a regular expression, a choice of strings or an
    EBNF grammar. The worker's sampler masks every token the constraint forbids
    (xgrammar, engine/structured_outputs.py), on every worker the request runs on."""
    json: str | None = option(None, "a JSON schema the output must satisfy (JSON text)")
    json_object: bool = option(False, "the output is one JSON object")
    regex: str | None = option(None, "a regular expression the output must match")
    choice: tuple[str, ...] | None = option(None, "the output is one of these strings")
    grammar: str | None = option(None, "an EBNF grammar (xgrammar's, GBNF-style) the output "
                                 "must match")
    # vLLM's flag of this name defaults to False (JSON may carry any whitespace); a
    # small model then pads with whitespace until max_tokens, so here it defaults on.
    disable_any_whitespace: bool = option(True, "JSON with single spaces after ':' and "
                                          "',', no other whitespace")

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        field = "structured_outputs"
        _require(len(self.kinds) == 1, field, "set exactly one of "
                 f"{', '.join(STRUCTURED_KINDS)}, got {list(self.kinds) or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and 0 < len(value)
                                       <= MAX_GRAMMAR_CHARS and _is_unicode(value)),
                     field, f"{name} must be non-empty text of at most "
                     f"{MAX_GRAMMAR_CHARS} characters")
        _require(self.choice is None or (0 < len(self.choice) <= MAX_CHOICES and all(
            isinstance(c, str) and c and _is_unicode(c) for c in self.choice)
            and sum(map(len, self.choice)) <= MAX_GRAMMAR_CHARS), field,
            f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        _require(isinstance(self.json_object, bool)
                 and isinstance(self.disable_any_whitespace, bool), field,
                 "json_object and disable_any_whitespace must be booleans")

    @classmethod
    def from_response_format(cls, response_format: dict) -> StructuredOutputsParams | None:
        """OpenAI's response_format (as its JSON): text -> None (unconstrained),
        json_object -> any object, json_schema -> its schema (strict or not, the output
        validates; without a schema, any object)."""
        field = "response_format"
        _require(isinstance(response_format, dict), field, "must be an object")
        kind = response_format.get("type")
        _require(kind in ("text", "json_object", "json_schema"), field,
                 f'type must be "text", "json_object" or "json_schema", got {kind!r}')
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        spec = response_format.get("json_schema")
        _require(isinstance(spec, dict), field, 'type "json_schema" needs json_schema')
        schema = spec.get("schema")
        return cls(json_object=True) if schema is None else cls(json=schema)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in STRUCTURED_KINDS
                     if getattr(self, k) not in (None, False))

    @property
    def kind(self) -> str:
        return self.kinds[0]


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
    min_tokens: int = option(0, "the fewest tokens to generate before eos or a stop token "
                             "may end the output (they are masked until then)", ge=0)
    logit_bias: dict[int, float] | None = option(
        None, f"token id -> a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to "
        "its logit before sampling")
    structured_outputs: StructuredOutputsParams | None = option(
        None, "constrain the output to a JSON schema, regex, choice or grammar")
    prompt_logprobs: int | None = option(
        None, "the logprob of each prompt token after those before it, and of this many "
        "most likely tokens there (vLLM's; the prompt is computed whole: no prefix-cache "
        "hits)", ge=0, le=MAX_TOP_LOGPROBS)
    n: int = option(1, "output sequences for the prompt, from one prefill: they share "
                    "its KV blocks (copy-on-write) and choice i draws with seed + i",
                    ge=1, le=MAX_N)

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
        _require(self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias) or None)
        _require(self.structured_outputs is None
                 or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", "must be a StructuredOutputsParams")
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of an n > 1 request as a sequence of its own: n 1, and a
        seeded request's seed + index (vLLM's rule), so choice i of a seeded request
        is reproducible and equals a request for one sequence with that seed (its
        prompt logprobs are choice 0's alone)."""
        if self.n == 1 and index == 0:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                       # the prompt's logprobs are the request's: choice 0 has them
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


_OPTIONAL = ("prompt_logprobs",)  # bounded fields that may be None (off)


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias}, the ids as integers (OpenAI's JSON keys are strings)."""
    _require(isinstance(bias, dict), "logit_bias", "must be a map of token id to bias")
    _require(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
             f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        _require(_is_int(token) and token >= 0, "logit_bias",
                 f"keys must be token ids (integers >= 0), got {key!r}")
        _require(_is_number(value) and math.isfinite(value)
                 and abs(value) <= MAX_LOGIT_BIAS, "logit_bias",
                 f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                 f"got {value!r} for {key!r}")
        out[token] = float(value)
    return out


def _check_bounds(params: SamplingParams) -> None:
    """Every bounded field: the right kind of number, within its range."""
    for name, integer, bounds in _bounded():
        value = getattr(params, name)
        if value is None and name in _OPTIONAL:
            continue
        kind = _is_int(value) if integer else _is_number(value)
        _require(kind and within(value, bounds), name,
                 f"must be {'an integer' if integer else 'a number'} {bounds_text(bounds)}, "
                 f"got {value!r}")


@functools.cache
def _bounded() -> tuple[tuple[str, bool, dict], ...]:
    hints = typing.get_type_hints(SamplingParams)
    return tuple((f.name, int in (hints[f.name], *typing.get_args(hints[f.name])), bounds_of(f))
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
