"""Turn logits into tokens: penalties, greedy, temperature, min-p, top-k, top-p,
per-request seeds. The order is vLLM's: penalties on the raw logits (greedy sees them
too), then temperature, then the truncations. Logprobs are of the raw logits, as
vLLM reports by default.

A seeded request's k-th output token is drawn from a generator seeded by (seed, k), so
it does not depend on where it is sampled: the prefill worker samples token 0 and a
decode worker the rest, a preempted request recomputes, batches differ, and the tokens
are the same as one engine sampling them all."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode import rejection_sampler

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): distinct streams for nearby seeds and indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int):
        self._default = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()
        # The distinct prompt tokens of requests with a repetition penalty, built once
        # per request rather than every step (a 2k-token prompt costs ~0.3 ms to set up).
        self._prompt_ids: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]
               ) -> tuple[list[int], list[float | None], list[dict[int, float] | None]]:
        """logits: [N, vocab] float32, row i for requests[i] -> per row one token, its
        logprob and the top logprobs {token: logprob} (None where not asked)."""
        params = [r.sampling_params for r in requests]
        raw = logits
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            logits = logits.clone()
            for i in penalized:
                _penalize(logits[i], params[i], self._distinct_prompt(requests[i], logits),
                          requests[i].output_token_ids)
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_one(logits[i], p, len(requests[i].output_token_ids))
        logprobs: list[float | None] = [None] * len(params)
        tops: list[dict[int, float] | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            rows = torch.log_softmax(raw[wanted], dim=-1)
            chosen = torch.tensor([tokens[i] for i in wanted], device=raw.device)
            values = rows.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            for j, (i, value) in enumerate(zip(wanted, values)):
                logprobs[i] = value
                if params[i].top_logprobs:
                    top = rows[j].topk(params[i].top_logprobs)
                    tops[i] = dict(zip(top.indices.tolist(), top.values.tolist()))
        return tokens, logprobs, tops

    def verify(self, logits: torch.Tensor, request: Request, drafts: list[int],
               argmax: list[int] | None = None
               ) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None]:
        """logits: [len(drafts) + 1, vocab] float32, row j after the request's tokens
        and drafts[:j] -> the tokens the step emits (accepted drafts, then the target's
        own), their logprobs and top logprobs (None where not asked). Each row is
        sampled as plain decoding samples that position (rejection_sampler.verify);
        `argmax`: the rows' argmax, when the caller has it for a whole batch."""
        p = request.sampling_params
        output = request.output_token_ids
        if p.penalized:
            prompt_ids = self._distinct_prompt(request, logits)

            def row(j: int) -> torch.Tensor:  # as plain decoding sees it: drafts as output
                penalized = logits[j].clone()
                _penalize(penalized, p, prompt_ids, output + drafts[:j])
                return penalized
        else:
            row = logits.__getitem__
        if p.greedy and not p.penalized:
            best = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
            sample_at = best.__getitem__
        elif p.greedy:
            def sample_at(j: int) -> int:
                return int(row(j).argmax())
        else:
            def sample_at(j: int) -> int:
                return self._sample_one(row(j), p, len(output) + j)
        run = rejection_sampler.verify(drafts, sample_at)
        if not p.logprobs:
            return run, None, None
        rows = torch.log_softmax(logits[:len(run)], dim=-1)
        chosen = torch.tensor(run, device=logits.device).unsqueeze(1)
        logprobs = rows.gather(1, chosen).squeeze(1).tolist()
        if not p.top_logprobs:
            return run, logprobs, None
        top = rows.topk(p.top_logprobs, dim=-1)
        return run, logprobs, [dict(zip(i, v)) for i, v in
                               zip(top.indices.tolist(), top.values.tolist())]

    def _sample_one(self, logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
        logits = logits.cpu() / p.temperature
        if p.min_p > 0:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p, the first token always
            # (a top_p below float32's range compares as 0 and would drop it too).
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
            drop[0] = False
            logits = logits.index_fill(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        if not bool(torch.isfinite(probs).all()):
            # Extreme penalties overflow a logit to inf (inf - inf is NaN in softmax):
            # the distribution has collapsed onto those tokens, so take the first.
            return int(logits.nan_to_num(nan=float("-inf")).argmax())
        if p.seed is None:
            generator = self._default
        else:
            generator = self._seeded.manual_seed(token_seed(p.seed, output_index))
        return int(torch.multinomial(probs, 1, generator=generator))

    def _distinct_prompt(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        ids = self._prompt_ids.get(request.request_id)
        if ids is None:
            ids = torch.tensor(request.prompt_token_ids, device=logits.device).unique()
            self._prompt_ids[request.request_id] = ids
        return ids


def _penalize(row: torch.Tensor, p: SamplingParams, prompt_ids: torch.Tensor,
              output: Sequence[int]) -> None:
    """In place on one row of logits; prompt_ids are the prompt's distinct tokens."""
    output_ids = torch.tensor(output, dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1:
        seen = torch.cat([prompt_ids, output_ids]).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                values * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        ids, counts = output_ids.unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
