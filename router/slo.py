"""A request's service-level objectives: time to first token and time per output
token (the mean over its output, as benchmarks measure it). Unset = best effort.
Requests carry them (gRPC fields, HTTP headers or body keys); the server's defaults
fill what a request leaves unset."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError

MAX_SLO_MS = 86_400_000.0  # a day: beyond it an SLO means nothing


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None,
                ttft_field: str = "slo_ttft_ms", tpot_field: str = "slo_tpot_ms") -> "Slo":
        """Checked: each unset, or a number of milliseconds in (0, a day]; an error
        names the field as the caller spelled it."""
        return cls(_seconds(ttft_ms, ttft_field), _seconds(tpot_ms, tpot_field))

    def over(self, default: "Slo") -> "Slo":
        """This SLO with what it leaves unset taken from `default`."""
        return Slo(self.ttft_s if self.ttft_s is not None else default.ttft_s,
                   self.tpot_s if self.tpot_s is not None else default.tpot_s)

    @property
    def best_effort(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None

    def ttft_met(self, ttft_s: float) -> bool:
        return self.ttft_s is None or ttft_s <= self.ttft_s

    def tpot_met(self, tpot_s: float) -> bool:
        return self.tpot_s is None or tpot_s <= self.tpot_s


def _seconds(ms, name: str) -> float | None:
    if ms is None:
        return None
    if isinstance(ms, bool) or not isinstance(ms, (int, float)):
        raise InvalidRequestError(name, "must be a number of milliseconds")
    if not math.isfinite(ms) or not 0 < ms <= MAX_SLO_MS:
        raise InvalidRequestError(name, f"must be > 0 and <= {MAX_SLO_MS:g} ms, not {ms!r}")
    return ms / 1000.0


def parse_ms(text: str | None, name: str) -> float | None:
    """A header's value as milliseconds (None when absent)."""
    if text is None:
        return None
    try:
        return float(text.strip())
    except ValueError:
        raise InvalidRequestError(name, f"must be a number of milliseconds, not {text!r}") \
            from None
