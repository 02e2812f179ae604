"""The pure routing choice (no I/O, no Ray): which workers to try, in order.

This issue's policy: decode workers by fewest requests in flight, then most free KV;
prefill workers by fewest queued prompt tokens, within a bounded queue. Goodput-aware
routing replaces it later behind the same signatures.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeLoad:
    worker_id: str
    inflight: int  # reserved + running, as the router counts them
    free_blocks: int  # as last reported
    num_blocks: int
    alive: bool = True


@dataclass(frozen=True)
class PrefillLoad:
    worker_id: str
    queued: int  # prefills sent and not yet answered
    queued_tokens: int  # their prompt tokens
    alive: bool = True


def decode_order(loads: list[DecodeLoad], blocks_needed: int) -> list[str]:
    """Every live decode worker, best first. Those that lacked room when last heard
    from go last rather than being skipped: that figure is stale by the time it is
    read, and asking costs one refusal."""
    def rank(w: DecodeLoad):
        return (w.free_blocks < blocks_needed, w.inflight, -w.free_blocks, w.worker_id)
    return [w.worker_id for w in sorted((w for w in loads if w.alive), key=rank)]


def prefill_choice(loads: list[PrefillLoad], num_tokens: int,
                   max_queued_tokens: int = 0) -> str | None:
    """The prefill worker with the fewest queued tokens whose queue has room for this
    prompt (an empty queue always has: one long prompt must not be refused forever);
    None when every live queue is full. max_queued_tokens 0 = unbounded."""
    def has_room(w: PrefillLoad) -> bool:
        return (not max_queued_tokens or w.queued == 0
                or w.queued_tokens + num_tokens <= max_queued_tokens)
    open_ = [w for w in loads if w.alive and has_room(w)]
    if not open_:
        return None
    return min(open_, key=lambda w: (w.queued_tokens, w.queued, w.worker_id)).worker_id
