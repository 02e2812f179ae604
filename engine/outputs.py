"""What the engine reports per request after each step."""
from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # every character handed out so far (stop string trimmed; a tail that
    #           may begin a stop string waits until it cannot, or the request ends)
    new_token_ids: list[int]  # produced by this step
    new_text: str
    finished: bool
    metrics: RequestMetrics
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # {token: logprob}
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # finish_reason "error": what failed
