"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int):
        self._default = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> tuple[list[int], list[float | None]]:
        # logits: [N, vocab] float32 -> one token (and its logprob if asked) per row
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_one(logits[i], p, request_ids[i])
        logprobs: list[float | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            rows = torch.log_softmax(logits[wanted], dim=-1)
            chosen = torch.tensor([tokens[i] for i in wanted], device=logits.device)
            values = rows.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            for i, value in zip(wanted, values):
                logprobs[i] = value
        return tokens, logprobs

    def _sample_one(self, logits: torch.Tensor, p: SamplingParams, request_id: str) -> int:
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
        return int(torch.multinomial(probs, 1, generator=self._generator(p, request_id)))

    def _generator(self, p: SamplingParams, request_id: str) -> torch.Generator:
        if p.seed is None:
            return self._default
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = self._per_request[request_id] = torch.Generator().manual_seed(p.seed)
        return gen
