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


@dataclass(frozen=True)
class Disaggregate:
    """`prefill` computes the prompt and streams its KV to `decode`, which generates."""
    prefill: str
    decode: str
    ttft_s: float | None = field(default=None, compare=False)
    tpot_s: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Reject:
    """429 / RESOURCE_EXHAUSTED with Retry-After."""
    reason: str
    retry_after_s: float
    kind: str = "overloaded"  # for metrics: overloaded | ttft | tpot | harm | kv
    # The best placement's forecast TTFT (from the request's arrival), were it placed
    # now (None: unknown): whether waiting for capacity could still meet its TTFT SLO.
    ttft_s: float | None = field(default=None, compare=False)


Decision = Colocate | Disaggregate | Reject
