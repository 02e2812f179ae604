"""Predictions from a worker's StepCost (latency_model.py): how long until a new
request's first token there, and the time per output token of the decode batch it
would join. The scheduler's shape is assumed: each step carries every running
decode and fills the rest of `token_budget` with prompt chunks, first come first
served. Pure arithmetic, shared by the router's policy and a capacity simulator."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.latency_model import StepCost


@dataclass(frozen=True)
class WorkerLoad:
    """What a forecast needs of one worker's load."""
    queued_tokens: int = 0  # prompt tokens to compute before a new request's
    queued_requests: int = 0  # the prompts they belong to
    decode_seqs: int = 0  # requests in its decode batch
    decode_context: int = 0  # their KV lengths, summed
    token_budget: int = SchedulerConfig.max_num_batched_tokens  # tokens per step
    # The share of its recent time spent computing prompts (latency_model.PromptShare):
    # prompts arriving while a request decodes there stretch its steps.
    prompt_share: float = 0.0
    # The most requests it runs at once (SchedulerConfig.max_num_seqs; 0: unbounded):
    # while that many run, its scheduler admits no prompt (slots_short).
    max_seqs: int = 0


# Above it the forecast would run away (a worker that only computed prompts lately
# still decodes between them).
_MAX_PROMPT_SHARE = 0.75


def prompt_pairs(tokens: int, cached: int = 0) -> int:
    """Causal attention pairs of computing tokens cached..tokens of a prompt."""
    new = max(tokens - cached, 0)
    return new * cached + new * (new + 1) // 2


def prompt_compute_seconds(cost: StepCost, tokens: int, cached: int = 0) -> float:
    """A prompt's own share of the steps that compute it: what it adds to the steps
    of the decodes running beside it."""
    return (cost.prefill_token_s * max(tokens - cached, 0)
            + cost.prefill_pair_s * prompt_pairs(tokens, cached))


def queue_compute_seconds(cost: StepCost, load: WorkerLoad) -> float:
    """The queued prompts' share (their lengths unknown: taken as equal)."""
    n = load.queued_requests
    each = load.queued_tokens // n if n else 0
    return n * prompt_compute_seconds(cost, each) if n else (
        cost.prefill_token_s * load.queued_tokens)


def slots_short(load: WorkerLoad) -> int:
    """How many of the requests running there must end before a new prompt, behind
    the queued ones, is admitted: each running request (decoding, computing its
    prompt, or reserved for KV on its way) and each queued prompt holds a slot of
    max_seqs. 0: it is admitted as the queue reaches it."""
    if not load.max_seqs:
        return 0
    return max(load.decode_seqs + load.queued_requests + 1 - load.max_seqs, 0)


def decode_step_seconds(cost: StepCost, load: WorkerLoad) -> float:
    """One step of the decode batch alone (the drafts its decodes verify included)."""
    return (cost.base_s + cost.decode_seq_s * load.decode_seqs
            + cost.decode_context_s * load.decode_context
            + cost.draft_token_s * cost.drafts_per_decode * load.decode_seqs)


def ttft_seconds(cost: StepCost, load: WorkerLoad, tokens: int, cached: int = 0) -> float:
    """From now until the prompt's last chunk is computed and its first token sampled,
    behind the queued prompts, every step also carrying the running decodes."""
    new = max(tokens - cached, 1)  # a full hit still computes its last token
    per_step = max(1, load.token_budget - load.decode_seqs)
    steps = -(-(load.queued_tokens + new) // per_step)
    return (steps * decode_step_seconds(cost, load) + queue_compute_seconds(cost, load)
            + prompt_compute_seconds(cost, tokens, tokens - new))


def tpot_seconds(cost: StepCost, load: WorkerLoad, prompt_tokens: int,
                 max_tokens: int) -> float:
    """Mean time per output token of a request joining the decode batch now: a step
    of the batch with it (its context at mid-generation), plus the prompt work queued
    there, which the steps carrying its decode compute too, spread over its output;
    all stretched by the prompts still to arrive while it decodes
    (with_prompts_to_come). With speculative decoding a step gives it
    cost.decode_yield tokens."""
    joined = WorkerLoad(decode_seqs=load.decode_seqs + 1,
                        decode_context=load.decode_context + prompt_tokens + max_tokens // 2)
    stall = queue_compute_seconds(cost, load)
    own = (decode_step_seconds(cost, joined) / max(cost.decode_yield, 1.0)
           + stall / max(1, max_tokens - 1))
    return with_prompts_to_come(own, load)


def with_prompts_to_come(seconds: float, load: WorkerLoad) -> float:
    """A decode's seconds per token stretched by the prompts still to arrive while it
    runs, at the worker's recent prompt share s (of every second, s goes to them:
    1 / (1 - s))."""
    return seconds / (1.0 - min(max(load.prompt_share, 0.0), _MAX_PROMPT_SHARE))


def joining_slowdown(cost: StepCost, prompt_tokens: int) -> float:
    """How much longer each step of a decode batch gets when a request of that
    prompt length joins it."""
    return cost.decode_seq_s + cost.decode_context_s * prompt_tokens
