"""Typed messages between the router and the workers (Ray actor calls). Plain data:
no tensors, no Ray; KV bytes only ever travel through kv_transfer."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Reservation:
    """A decode worker's answer to `reserve`: where the prompt's KV must go."""
    request_id: str
    receiver_address: str  # the decode worker's kv_transfer rendezvous
    block_ids: list[int]  # for the whole prompt, in order
    num_cached_blocks: int  # leading blocks the decode worker already holds


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    target: Reservation
    arrival_time: float


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    first_logprob: float | None
    first_top_logprobs: dict[int, float] | None
    kv_bytes_sent: int
    prefill_seconds: float  # first scheduled -> KV confirmed on the decode worker


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    token_ids: list[int]  # new since the last delta
    text: str  # new since the last delta
    logprobs: list[float]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # {token: logprob}
    error: str | None = None  # finish_reason "error": what failed

    def merged(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by `later`, as one (for a consumer that fell behind)."""
        return TokenDelta(self.request_id, self.token_ids + later.token_ids,
                          self.text + later.text, self.logprobs + later.logprobs,
                          later.finished, later.finish_reason, later.num_prompt_tokens,
                          later.num_cached_tokens, later.num_output_tokens,
                          self.top_logprobs + later.top_logprobs, later.error)


@dataclass(frozen=True)
class StepBatch:
    """One or more engine steps' new tokens for every request they advanced."""
    worker_id: str
    deltas: list[TokenDelta]

    def merged(self, later: "StepBatch") -> "StepBatch":
        by_request = {d.request_id: d for d in self.deltas}
        for d in later.deltas:
            earlier = by_request.get(d.request_id)
            by_request[d.request_id] = d if earlier is None else earlier.merged(d)
        return StepBatch(self.worker_id, list(by_request.values()))
