"""What one engine step computed, and how long it took: the input of the latency
model (step duration as a function of the step's shape). Pure data."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of requests catching up (prompt chunks, recompute)
    # Causal attention pairs of those chunks: a chunk of n tokens after c computed
    # ones has n*c + n*(n+1)/2 (query, key) pairs.
    prefill_pairs: int = 0
    decode_seqs: int = 0  # requests computing their one newest token
    decode_context: int = 0  # keys those decodes attend to (their KV length)
    # Speculative decoding: draft tokens some of those decodes verify beside it.
    draft_tokens: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepShape":
        prefill = pairs = decode = context = 0
        drafts = out.spec_token_ids
        for request, n in zip(out.requests, out.num_scheduled):
            computed = request.num_computed_tokens
            if (n == 1 or (drafts and request.request_id in drafts)) \
                    and computed + 1 == request.num_tokens and request.num_output_tokens:
                decode += 1
                context += computed + 1
            else:
                prefill += n
                pairs += n * computed + n * (n + 1) // 2
        num_drafts = sum(map(len, drafts.values())) if drafts else 0
        return cls(prefill, pairs, decode, context, num_drafts)


@dataclass(frozen=True)
class StepTiming:
    shape: StepShape
    duration_s: float  # schedule to outputs, the forward pass (and drafting) included
    end_time: float  # wall clock on the worker
    # Tokens the decodes gained: one each, and the drafts their verifications
    # accepted (None: one each, a worker without speculative decoding).
    decode_tokens: int | None = None
