"""What `decide` answers for one request; the router carries it out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Colocate:
    """The worker (role both) runs the whole request, prefill included."""
    worker: str
    # What the policy predicted for the request (None: a policy without a model);
    # its TTFT from the request's arrival, as the SLO counts it.
    ttft_s: float | None = field(default=None, compare=False)
    tpot_s: float | None = field(default=None, compare=False)
    # The calibration factors those forecasts were scaled by (the TTFT's part from
    # placement on): what the model forecast itself is theirs divided by these.
    ttft_scale: float = field(default=1.0, compare=False)
    tpot_scale: float = field(default=1.0, compare=False)


@dataclass(frozen=True)
class Disaggregate:
    """`prefill` computes the prompt and streams its KV to `decode`, which generates."""
    prefill: str
    decode: str
    ttft_s: float | None = field(default=None, compare=False)
    tpot_s: float | None = field(default=None, compare=False)
    ttft_scale: float = field(default=1.0, compare=False)
    tpot_scale: float = field(default=1.0, compare=False)


@dataclass(frozen=True)
class Reject:
    """429 / RESOURCE_EXHAUSTED with Retry-After."""
    reason: str
    retry_after_s: float
    # for metrics: overloaded | ttft | tpot | harm | kv | unattainable (its TTFT SLO
    # could not be met on idle workers: the router answers 400, not 429)
    kind: str = "overloaded"
    # The best placement's forecast TTFT (from the request's arrival), were it placed
    # now (None: unknown): whether waiting for capacity could still meet its TTFT SLO.
    ttft_s: float | None = field(default=None, compare=False)


Decision = Colocate | Disaggregate | Reject


def placement_kind(decision: Colocate | Disaggregate) -> str:
    """colocate | disaggregate: the label of metrics and calibrations."""
    return "colocate" if isinstance(decision, Colocate) else "disaggregate"
