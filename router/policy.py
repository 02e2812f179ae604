"""The pure routing choice (no I/O, no Ray): which workers to try, in order.

This issue's policy: decode workers by fewest requests in flight, then most free KV;
prefill workers by fewest queued prefills. Goodput-aware routing replaces it later
behind the same signatures.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeLoad:
    worker_id: str
    inflight: int  # reserved + running, as the router counts them
    free_blocks: int  # as last reported
    num_blocks: int


@dataclass(frozen=True)
class PrefillLoad:
    worker_id: str
    queued: int  # prefills sent and not yet answered


def decode_order(loads: list[DecodeLoad], blocks_needed: int) -> list[str]:
    """Decode workers worth asking to reserve, best first (those lacking room last
    known are skipped)."""
    fit = [w for w in loads if w.free_blocks >= blocks_needed]
    return [w.worker_id for w in sorted(fit, key=lambda w: (w.inflight, -w.free_blocks,
                                                             w.worker_id))]


def prefill_choice(loads: list[PrefillLoad]) -> str | None:
    if not loads:
        return None
    return min(loads, key=lambda w: (w.queued, w.worker_id)).worker_id
