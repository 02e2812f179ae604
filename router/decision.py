"""What `decide` answers for one request; the router carries it out."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Colocate:
    """The worker (role both) runs the whole request, prefill included."""
    worker: str


@dataclass(frozen=True)
class Disaggregate:
    """`prefill` computes the prompt and streams its KV to `decode`, which generates."""
    prefill: str
    decode: str


@dataclass(frozen=True)
class Reject:
    """429 / RESOURCE_EXHAUSTED with Retry-After."""
    reason: str
    retry_after_s: float


Decision = Colocate | Disaggregate | Reject
