"""What the scheduler decides for one step, and what the model runner hands back."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request


@dataclass
class KVCopies:
    """A step's copies between the device's KV blocks and host memory's
    (engine/host_pool.py), run before its forward pass, to_host first: a swap-out, a
    block stored in the prefix tier; then to_device: a swap-in, a prefix-tier hit
    loaded; then within the device: a shared, partly filled block copied before a
    request writes into it (BlockManager.own_tail). Every block named is pinned until
    the step's copies ran."""
    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    within: list[tuple[int, int]] = field(default_factory=list)  # (device, device)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.within)


@dataclass
class SchedulerOutput:
    # Batch order. requests[i] computes num_scheduled[i] tokens starting at its
    # num_computed_tokens, into the KV slots of its block_ids.
    requests: list[Request] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # request id -> the draft tokens it verifies this step (speculative decoding): its
    # num_scheduled is 1 + their number, its last known token then the drafts.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_running: int = 0  # running requests once scheduled: all in `requests` when equal
    steady: bool = False  # every running request decodes one token (Scheduler's fast path)
    kv_copies: KVCopies | None = None  # host-memory copies run before the forward pass

    @property
    def has_work(self) -> bool:
        """A forward pass to run, or copies."""
        return bool(self.requests or self.kv_copies)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class ModelRunnerOutput:
    # request id -> token sampled this step; only requests whose chunk reached the
    # end of their known tokens sample (a partial prefill chunk samples nothing).
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request id -> logprob of that token; only requests that asked for logprobs.
    logprobs: dict[str, float] = field(default_factory=dict)
    # request id -> {token: logprob} of the most likely tokens; those that asked.
    top_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # request id -> why sampling failed for it alone (it finishes with an error)
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> what verifying its drafts emitted (requests scheduled with drafts;
    # they are not in sampled_token_ids)
    verified: dict[str, "Verified"] = field(default_factory=dict)
    # request id -> the first tokens of its choices 1 .. n-1 (token, logprob, top
    # logprobs): a request for n > 1 sequences that sampled its first token
    choices: dict[str, list[tuple[int, float | None, dict[int, float] | None]]] = field(
        default_factory=dict)


@dataclass
class Verified:
    """The tokens one verification step emits for a request: the accepted drafts, then
    the target's own token (1 to k + 1), with their logprobs where asked."""
    token_ids: list[int]
    num_accepted: int  # drafts accepted by the sampler (a stop may end the run sooner)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens admitted, prefix-cache hits included
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_preemptions: int = 0
    num_preemptions_for_waiting: int = 0  # of those, by the waiting-timeout rule
    # Swap preemption (preemption_mode swap or auto): requests swapped out and back
    # in, and their blocks.
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    # The host prefix tier: prompt tokens served from it (counted in prefix_cache_hits
    # too) and the blocks loaded back from it.
    host_prefix_cache_hits: int = 0
    num_host_blocks_loaded: int = 0
    # Speculative decoding, under vLLM's names: verification steps of one request,
    # the draft tokens they verified and accepted, and accepted drafts by position
    # (index j: steps whose j-th draft was accepted).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
