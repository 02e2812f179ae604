"""Speculative decoding's settings, in vLLM's shape:

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 4}

Frozen and validated where built; the engine argument `speculative_config` (and
`pdserve serve --speculative-config JSON`) takes this or the dict."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from pdserve.engine.options import option

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = option("ngram", "ngram (prompt lookup) or draft_model", choices=METHODS)
    num_speculative_tokens: int = option(4, "draft tokens proposed per step (k)", ge=1)
    prompt_lookup_min: int = option(1, "ngram: the shortest suffix matched", ge=1)
    prompt_lookup_max: int = option(5, "ngram: the longest suffix matched", ge=1)
    model: str | None = option(None, "draft_model: a local HF directory sharing the "
                               "target's tokenizer (or `tiny`)")

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", f"must be one of {METHODS}")
        _check(_is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 1,
               "num_speculative_tokens", "must be an integer >= 1")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
               "prompt_lookup_min", "must be an integer >= 1")
        _check(_is_int(self.prompt_lookup_max)
               and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", "must be an integer >= prompt_lookup_min")
        _check((self.model is not None) == (self.method == "draft_model"), "model",
               "is the draft model's directory: required by draft_model, "
               "meaningless otherwise")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a request keeps for the proposer: a draft
        model writes its own KV for its drafts there (all but the last)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From itself, a dict, or its JSON (a CLI flag)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be an object")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}")
        return cls(**value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{name} {why}")
