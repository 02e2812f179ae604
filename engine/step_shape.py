"""What one engine step computed, and how long it took: the input of the latency
model (step duration as a function of the step's shape). Pure data."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int  # tokens of requests catching up (prompt chunks, recompute)
    decode_seqs: int  # requests computing their one newest token
    context_tokens: int  # tokens already in the KV cache that the step's attention reads

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepShape":
        prefill = decode = context = 0
        for request, n in zip(out.requests, out.num_scheduled):
            context += request.num_computed_tokens
            if n == 1 and request.num_computed_tokens + 1 == request.num_tokens \
                    and request.num_output_tokens:
                decode += 1
            else:
                prefill += n
        return cls(prefill, decode, context)


@dataclass(frozen=True)
class StepTiming:
    shape: StepShape
    duration_s: float  # schedule to outputs, the forward pass included
    end_time: float  # wall clock on the worker
