"""Typed messages between the router and the workers (Ray actor calls). Plain data:
no tensors, no Ray; KV bytes only ever travel through kv_transfer."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_shape import StepTiming

# A worker's roles: prefill (prompts for another worker's decode), decode (requests
# prefilled elsewhere), both (whole requests, prefill included: colocated).
ROLES = ("prefill", "decode", "both")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidRequestError("role", f"must be one of {', '.join(ROLES)}, not {role!r}")


@dataclass(frozen=True)
class Reservation:
    """A decode worker's answer to `reserve`: where the prompt's KV must go."""
    request_id: str
    receiver_address: str  # the decode worker's kv_transfer rendezvous
    block_ids: list[int]  # for the whole prompt, in order
    num_cached_blocks: int  # leading blocks the decode worker already holds


@dataclass(frozen=True)
class Job:
    """A request as a worker takes it: reserved for (decode side), submitted whole
    (role both), or prefilled for another worker (PrefillJob)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # wall clock when the router accepted it
    # A request moved here (migration): the tokens it generated elsewhere, run as its
    # outputs (max_tokens, penalties, seeded draws and stop strings go on from them),
    # and how many characters of their text its client has (its stream goes on after).
    output_token_ids: tuple[int, ...] = ()
    text_sent: int = 0
    # The TTFT SLO the router judges it by (None: none): a worker admits it ahead of
    # a running decode once it waited past a share of it (the waiting timeout).
    ttft_slo_s: float | None = None

    def params_here(self, computes_prompt: bool) -> SamplingParams:
        """What a worker runs it with: prompt logprobs only where the prompt is
        computed for its first token (a prefill or colocated worker, before any output).
        A decode worker scoring it again (its prompt recomputed after a preemption, with
        no prefix-cache hit) would do it for nobody."""
        params = self.sampling_params
        if params.prompt_logprobs is None or (computes_prompt and not self.output_token_ids):
            return params
        return replace(params, prompt_logprobs=None)


@dataclass(frozen=True)
class PrefillJob:
    job: Job
    target: Reservation  # where its KV goes

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def params(self) -> SamplingParams:
        """What the prefill worker runs the prompt with: only the first token is
        sampled there (after those a migrated request generated before); stop
        conditions are the decode side's."""
        params, done = self.job.params_here(True), len(self.job.output_token_ids)
        # Under min_tokens its token may not be a stop token: the sampler masks the
        # stop tokens, which therefore stay known (and so cannot end it early here).
        stops = {} if params.min_tokens > done else {"stop_token_ids": (), "ignore_eos": True}
        return replace(params, max_tokens=done + 1, stop=(),
                       min_tokens=min(params.min_tokens, done + 1), **stops)


@dataclass(frozen=True)
class WorkerStats:
    """What the router asks a worker for outside its telemetry."""
    num_blocks: int
    free_blocks: int
    # kv_transfer lease -> how many expired on this worker (its receiver's LEASES)
    lease_expiries: dict[str, int] = field(default_factory=dict)
    # Names the worker's process: a restarted worker answers with a new one.
    incarnation: str = ""


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    first_logprob: float | None
    first_top_logprobs: dict[int, float] | None
    kv_bytes_sent: int
    prefill_seconds: float  # first scheduled -> KV confirmed on the decode worker
    # The transfer's exposed part: the last prefill step's end -> KV confirmed.
    transfer_seconds: float = 0.0
    # Prompt tokens the prefill worker's prefix cache served: the request's cached
    # tokens (usage), which the decode side, its KV sent, cannot see; of those, the
    # ones loaded from its host tier.
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: computed here, with the prompt.
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # SamplingParams.n > 1: choices 1 .. n-1's first tokens (token, logprob, top
    # logprobs), drawn from the same logits row as first_token; the one transfer
    # serves them all (the decode worker forks them at start).
    choices: list[tuple[int, float | None, dict[int, float] | None]] = field(
        default_factory=list)

    @property
    def choice_tokens(self) -> list[int]:
        return [token for token, _, _ in self.choices]


@dataclass(frozen=True)
class Paused:
    """A source's answer to `pause` (live migration): what the request produced before
    it left the batch, the KV of its first num_computed_tokens tokens kept for a last
    copy."""
    request_id: str
    output_token_ids: list[int]
    text_sent: int  # characters of their text handed out (its last delta included)
    num_computed_tokens: int


@dataclass(frozen=True)
class BlockCopy:
    """One copy of a live migration: the source's blocks [first_block, first_block +
    len(target_blocks)) of its request go into `target_blocks` of the target, as the
    transfer `transfer_id` the target expects."""
    transfer_id: str
    request_id: str  # as the source knows it
    first_block: int
    target_address: str  # the target's kv_transfer rendezvous
    target_blocks: list[int]
    final: bool = False  # the request is paused: its last, partly filled block goes too


@dataclass(frozen=True)
class IncomingCopy:
    """What a live migration's target is told before a copy: the tokens the request
    made on its source since the target last heard (its outputs grow by them), how
    much of their text its client has, and the copy to expect: the request's whole
    computed blocks from first_block on (final: all, the last partly filled; it
    decodes on once that copy landed)."""
    request_id: str  # as the target knows it
    transfer_id: str
    first_block: int
    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0
    final: bool = False


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
    num_host_cached_tokens: int = 0  # of num_cached_tokens, loaded from the host tier
    num_output_tokens: int = 0
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # {token: logprob}
    error: str | None = None  # finish_reason "error": what failed
    # The request left the batch to move (live migration): its last delta here, sent
    # on the step stream after every token it made here.
    paused: bool = False
    # With finish_reason "error": this worker failed the request, not the request
    # itself (it was freed here): the router may place it again (migration by replay).
    worker_failed: bool = False
    # SamplingParams.prompt_logprobs, with the first token (RequestOutput's).
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # SamplingParams.n > 1: the choice it is of (the router's stream to its client).
    index: int = 0

    @staticmethod
    def not_resumed(request_id: str, exc: Exception) -> "TokenDelta":
        """The last delta of a request moved live whose target could not take it into
        its batch once its KV landed: freed there, to be placed again."""
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        return TokenDelta(request_id=request_id, token_ids=[], text="", logprobs=[],
                          finished=True, finish_reason="error",
                          error=f"it could not resume after its move ({type(exc).__name__}: "
                                f"{reason})", worker_failed=True)

    def merged(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by `later`, as one (for a consumer that fell behind)."""
        return replace(later, token_ids=self.token_ids + later.token_ids,
                       text=self.text + later.text, logprobs=self.logprobs + later.logprobs,
                       top_logprobs=self.top_logprobs + later.top_logprobs,
                       prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


@dataclass(frozen=True)
class WorkerTelemetry:
    """A worker's load as it measured it, published with every engine step and at
    least once a second while idle. The gauges are as of `time`; `steps` and the
    prefix-cache events are those since the previous report."""
    worker_id: str
    role: str  # prefill | decode | both
    time: float  # wall clock on the worker
    waiting: int  # requests queued for their (first) prefill chunk
    waiting_tokens: int  # their prompt tokens still to compute
    running: int  # requests in the batch
    context_tokens: int  # tokens the running requests hold in KV
    reserved: int  # decode role: blocks held for a prompt whose KV is on its way
    free_blocks: int
    num_blocks: int
    num_preemptions: int  # cumulative
    token_budget: int = 0  # tokens per step (max_num_batched_tokens); 0: unknown
    steps: tuple[StepTiming, ...] = ()
    # Block hashes (as the block manager chains them) made findable / evicted since
    # the last report: its net change, so no hash is in both (net_prefix_events).
    prefix_stored: tuple[bytes, ...] = ()
    prefix_evicted: tuple[bytes, ...] = ()
    # Speculative decoding, cumulative (SchedulerStats' spec_decode_*): verifications,
    # draft tokens verified, accepted, and accepted by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # The most requests it runs at once (max_num_seqs): no prompt is admitted while
    # that many run. 0: unbounded, or unknown.
    max_num_seqs: int = 0
    # Of num_preemptions, those the waiting timeout made (cumulative).
    num_preemptions_for_waiting: int = 0
    # Host memory (engine/host_pool.py). Swap preemption: requests swapped out now,
    # and cumulative requests and blocks swapped out and back in. The host prefix
    # tier: prompt tokens served from it, blocks stored, evicted and loaded back
    # (cumulative). Host blocks in all (swap area and tier) and in use.
    swapped: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    host_prefix_cache_hits: int = 0
    host_blocks_stored: int = 0
    host_blocks_evicted: int = 0
    host_blocks_loaded: int = 0
    host_num_blocks: int = 0
    host_used_blocks: int = 0
    # The host prefix tier's block hashes stored / dropped since the last report (its
    # net change, as prefix_stored / prefix_evicted are the device's), and what
    # loading one block from it back to the device takes (measured at start).
    host_prefix_stored: tuple[bytes, ...] = ()
    host_prefix_evicted: tuple[bytes, ...] = ()
    host_load_s_per_block: float = 0.0

    def merged(self, later: "WorkerTelemetry") -> "WorkerTelemetry":
        """`later`'s gauges with both reports' steps, and their events' net change."""
        stored, evicted = _merged_events(self.prefix_stored, self.prefix_evicted,
                                         later.prefix_stored, later.prefix_evicted)
        host_stored, host_evicted = _merged_events(
            self.host_prefix_stored, self.host_prefix_evicted, later.host_prefix_stored,
            later.host_prefix_evicted)
        return replace(later, steps=self.steps + later.steps, prefix_stored=stored,
                       prefix_evicted=evicted, host_prefix_stored=host_stored,
                       host_prefix_evicted=host_evicted)


def _merged_events(stored, evicted, later_stored, later_evicted):
    return net_prefix_events([(h, True) for h in stored] + [(h, False) for h in evicted]
                             + [(h, True) for h in later_stored]
                             + [(h, False) for h in later_evicted])


def net_prefix_events(events) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(hash, stored) events in order -> (stored, evicted) hashes by each one's last
    event: a block evicted and then stored again is held; stored and then evicted,
    it is not."""
    last = {h: stored for h, stored in events}
    return (tuple(h for h, stored in last.items() if stored),
            tuple(h for h, stored in last.items() if not stored))


@dataclass(frozen=True)
class StepBatch:
    """One or more engine steps' new tokens for every request they advanced (a
    subscriber's own requests only), with the worker's telemetry as of the last one
    (None: nothing measured since the previous batch)."""
    worker_id: str
    deltas: list[TokenDelta]
    telemetry: WorkerTelemetry | None = None

    def merged(self, later: "StepBatch") -> "StepBatch":
        by_request = {d.request_id: d for d in self.deltas}
        for d in later.deltas:
            earlier = by_request.get(d.request_id)
            by_request[d.request_id] = d if earlier is None else earlier.merged(d)
        telemetry = self.telemetry
        if later.telemetry is not None:
            telemetry = later.telemetry if telemetry is None else telemetry.merged(
                later.telemetry)
        return StepBatch(worker_id=self.worker_id, deltas=list(by_request.values()),
                         telemetry=telemetry)
