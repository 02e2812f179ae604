"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request's k-th output token is drawn from a generator seeded by (seed, k), so
it does not depend on where it is sampled: the prefill worker samples token 0 and a
decode worker the rest, a preempted request recomputes, batches differ, and the tokens
are the same as one engine sampling them all."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

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

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_index: list[int]) -> tuple[list[int], list[float | None]]:
        """logits: [N, vocab] float32 -> one token (and its logprob if asked) per row;
        output_index[i] is how many output tokens row i's request has already."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_one(logits[i], p, output_index[i])
        logprobs: list[float | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            rows = torch.log_softmax(logits[wanted], dim=-1)
            chosen = torch.tensor([tokens[i] for i in wanted], device=logits.device)
            values = rows.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            for i, value in zip(wanted, values):
                logprobs[i] = value
        return tokens, logprobs

    def _sample_one(self, logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
        logits = logits.cpu() / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
            logits = logits.index_fill(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        if p.seed is None:
            generator = self._default
        else:
            generator = self._seeded.manual_seed(token_seed(p.seed, output_index))
        return int(torch.multinomial(probs, 1, generator=generator))
