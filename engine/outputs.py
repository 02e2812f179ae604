"""What the engine reports per request after each step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class Outputs:
    """A request's output so far, without copying it: its own lists (which only grow
    while it runs) and how much of each this moment had. A step's output holds one,
    so its cost does not grow with the request's length; a list is made only when
    read."""
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    num_tokens: int
    num_logprobs: int
    num_top_logprobs: int

    @classmethod
    def of(cls, token_ids: list[int], logprobs: list[float] = (),
           top_logprobs: list[dict[int, float]] = ()) -> "Outputs":
        return cls(token_ids, logprobs, top_logprobs, len(token_ids), len(logprobs),
                   len(top_logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: Outputs  # every output token (and logprob) so far: token_ids, logprobs
    text: str  # every character handed out so far (stop string trimmed; a tail that
    #           may begin a stop string waits until it cannot, or the request ends)
    new_token_ids: list[int]  # produced by this step
    new_text: str
    finished: bool
    metrics: RequestMetrics
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (both tiers)
    num_host_cached_tokens: int = 0  # of those, loaded from the host prefix tier
    error: str | None = None  # finish_reason "error": what failed
    # SamplingParams.prompt_logprobs, once the prompt is computed: per prompt position
    # (logprob, rank, {token: logprob} top ones), None at position 0.
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # SamplingParams.n > 1, from its first token on: the first tokens of choices
    # 1 .. n-1 (token, logprob, top logprobs), drawn from the same logits row (where
    # they run on, each reports as a request of its own: request.choice_id).
    choices: list[tuple[int, float | None, dict[int, float] | None]] | None = None

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far (a copy, made now)."""
        o = self.outputs
        return o.token_ids[:o.num_tokens]

    @property
    def logprobs(self) -> list[float]:
        o = self.outputs
        return o.logprobs[:o.num_logprobs]

    @property
    def top_logprobs(self) -> list[dict[int, float]]:  # {token: logprob} per token
        o = self.outputs
        return o.top_logprobs[:o.num_top_logprobs]

    @property
    def num_output_tokens(self) -> int:
        return self.outputs.num_tokens

    @property
    def new_logprobs(self) -> list[float]:
        """This step's new tokens' logprobs (the first token, sampled by a prefill
        worker, has none on the decode side)."""
        o, n = self.outputs, len(self.new_token_ids)
        return list(o.logprobs[max(o.num_logprobs - n, 0):o.num_logprobs]) \
            if o.num_logprobs and n else []

    @property
    def new_top_logprobs(self) -> list[dict[int, float]]:
        o, n = self.outputs, len(self.new_token_ids)
        return list(o.top_logprobs[max(o.num_top_logprobs - n, 0):o.num_top_logprobs]) \
            if o.num_top_logprobs and n else []
