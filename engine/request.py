"""One request's state inside the engine.

There is no prefill or decode phase: `num_computed_tokens` catches up with
`num_tokens`. Prefill chunks, prefix-cache hits, KV imported from a prefill worker and
recompute after preemption all just move that counter.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


def choice_id(request_id: str, index: int) -> str:
    """The id choice `index` of an n > 1 request runs under on a worker: choice 0 is
    the request itself, the others are forked from it at its first token (a client's
    id is printable: never one of these)."""
    return request_id if index == 0 else f"{request_id}{_CHOICE}{index}"


def parent_of(request_id: str) -> str | None:
    """The request a choice id (choice_id's, index > 0) was forked from; None for any
    other id."""
    parent, sep, _ = request_id.rpartition(_CHOICE)
    return parent if sep else None


_CHOICE = "\x1fchoice-"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; the prompt's KV is arriving
    RUNNING = "running"
    PAUSED = "paused"  # out of the batch, its KV kept: moving to another worker
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted with its KV copied to host memory, to resume from
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"  # a step failed for this request alone (Request.error says why)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_host_cached_tokens: int = 0  # of those, loaded from the host prefix tier
    num_preemptions: int = 0
    # The TTFT it is judged by (the router's SLO for it; None: none): one waiting past
    # a share of it may preempt a running decode to be admitted (scheduler.py).
    ttft_slo_s: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None  # why it finished with FinishReason.ERROR
    # Owned by the block manager: KV block ids in token order, and the chained
    # hashes of this request's full blocks (prefix caching).
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # Swapped out: the host swap blocks holding its computed blocks, in order.
    host_block_ids: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: per prompt position, (the token's logprob after
    # those before it, its rank there (1: the most likely), the top ones there
    # {token: logprob}); position 0 has none.
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # Speculative decoding: draft tokens proposed for the next step, taken (and
    # cleared) by the scheduler when it schedules the request.
    spec_token_ids: list[int] = field(default_factory=list)
    # Parallel sampling (SamplingParams.n > 1): the first tokens of choices 1 .. n-1,
    # (token, logprob, top logprobs), drawn from the same logits row as this one's
    # (the sampler's, at its first token). forks_here: the choices then run here as
    # requests of their own, sharing this one's blocks (the scheduler forks them); a
    # prefill worker only draws them (the decode worker forks). shared_tail: its
    # last, partly filled block is shared with a sibling: copied before it writes.
    choices: list[tuple[int, float | None, dict[int, float] | None]] | None = None
    forks_here: bool = True
    shared_tail: bool = False
    # Kept as plain attributes (not properties): read per request per step.
    num_tokens: int = field(init=False)  # prompt + output tokens
    max_num_tokens: int = field(init=False)  # where max_tokens / the context stops it
    stop_token_set: frozenset[int] = field(init=False)  # eos (unless ignored) + stop ids
    scores_prompt: bool = field(init=False)  # asks for prompt logprobs
    num_choices: int = field(init=False)  # n, until its first token forks the others

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        limit = len(self.prompt_token_ids) + params.max_tokens
        self.max_num_tokens = min(limit, self.max_model_len or limit)
        eos = () if params.ignore_eos else self.eos_token_ids
        self.stop_token_set = frozenset(eos) | frozenset(params.stop_token_ids)
        self.scores_prompt = params.prompt_logprobs is not None
        # a request moved after its first token runs one sequence: its own
        self.num_choices = 1 if self.output_token_ids else params.n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    def prompt_logprob_positions(self, start: int, num_tokens: int) -> range:
        """Of the positions start .. start + num_tokens computed in a step, those whose
        logits give a prompt token's logprob (the next position's token): none unless
        the request asks for prompt logprobs."""
        if not self.scores_prompt:
            return range(0)
        return range(start, min(start + num_tokens, len(self.prompt_token_ids) - 1))

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def fork(self, index: int) -> Request:
        """Choice `index` of this request (n > 1) at its first token: the same prompt,
        SamplingParams.for_choice(index), no outputs yet (the caller gives it its
        first token and its blocks)."""
        child = Request(choice_id(self.request_id, index), self.prompt_token_ids,
                        self.sampling_params.for_choice(index), self.arrival_time,
                        eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        child.ttft_slo_s = self.ttft_slo_s
        child.num_cached_tokens = self.num_cached_tokens
        child.num_host_cached_tokens = self.num_host_cached_tokens
        return child

    def append_output(self, token_id: int, logprob: float | None = None,
                      top_logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def extend_output(self, token_ids: list[int]) -> None:
        """Several sampled tokens at once (no logprobs): steady_batch.advance."""
        self.output_token_ids.extend(token_ids)
        self.num_tokens += len(token_ids)

    def drop_outputs(self, num: int) -> None:
        """The last `num` output tokens (and their logprobs) taken back: a stop string
        completed before the end of what a verification step accepted."""
        if num <= 0:
            return
        kept = len(self.output_token_ids) - num
        del self.output_token_ids[kept:]
        self.num_tokens -= num
        for values in (self.output_logprobs, self.output_top_logprobs):
            del values[max(len(values) - num, 0):]

    def check_stop(self) -> FinishReason | None:
        """Stop conditions that need no text: eos, stop tokens, max_tokens, context."""
        last = self.output_token_ids[-1]
        if last in self.stop_token_set:
            self.stop_reason = last
            return FinishReason.STOP
        if self.num_tokens >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None
