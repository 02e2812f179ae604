"""Verification of draft tokens: which of a proposer's k guesses the target model
keeps, and the token after them, so that the output is distributed exactly as
decoding one token at a time would make it.

A verification step computes the target's logits at k+1 positions: after the last
known token, and after each draft token. Row j holds the target's distribution p_j
for output position n+j given the known tokens and drafts d_0..d_{j-1}.

Deterministic drafts (`verify`): the proposers here (prompt lookup, a draft model's
argmax) give one draft per position, a one-hot q. The target's token at each position
is drawn exactly as plain decoding draws it there (greedy: the argmax; random: the
request's sampler, seeded by (seed, position) when seeded); drafts are kept while
they equal it, and the run ends with the first token that differs, or with the token
after the last draft. This is vLLM's rejection sampling for q = onehot(d): d is
accepted with probability min(1, p(d) / q(d)) = p(d), and a rejected position's token
is distributed as p without d, renormalized, which is the recovered distribution
norm(max(p - q, 0)). One draw per position serves both, so a seeded request's k-th
token is the very token plain decoding draws: the same with or without speculation,
on a prefill or a decode worker, before or after preemption.

Drafts sampled from a distribution q (`rejection_sample`): vLLM's rule, accept d_j
when u < p_j(d_j) / q_j(d_j) (u uniform), else draw from norm(max(p_j - q_j, 0)); all
k accepted, a bonus token from p_k. Its output is distributed as p at every position
(tests/engine/test_rejection_sampler.py), for a proposer that samples its drafts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def verify(draft_token_ids: Sequence[int], sample_at: Callable[[int], int]) -> list[int]:
    """The tokens a verification emits: sample_at(j) is the target's token at row j
    (drawn as plain decoding would). Between 1 and len(drafts) + 1 tokens; all but the
    last are accepted drafts."""
    run = []
    for j, draft in enumerate(draft_token_ids):
        token = sample_at(j)
        run.append(token)
        if token != draft:
            return run  # rejected: the target's own token replaces the draft
    run.append(sample_at(len(draft_token_ids)))  # every draft kept: one more
    return run


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                     draft_probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """target_probs: [k+1, V], row j the target's distribution at draft position j;
    draft_probs: [k, V], the distribution each draft was sampled from. The emitted
    tokens, as `verify`."""
    # target_probs: [k+1, V]; draft_probs: [k, V]
    assert target_probs.shape[0] == len(draft_token_ids) + 1 == draft_probs.shape[0] + 1
    run = []
    for j, draft in enumerate(draft_token_ids):
        p, q = target_probs[j], draft_probs[j]
        u = float(torch.rand((), generator=generator))
        if u * float(q[draft]) < float(p[draft]):  # accept with min(1, p(d) / q(d))
            run.append(draft)
            continue
        recovered = (p - q).clamp_min(0)
        total = float(recovered.sum())
        # p == q everywhere it matters leaves nothing to recover: then p itself
        # (the draft was accepted with probability 1 there anyway).
        weights = recovered / total if total > 0 else p
        run.append(int(torch.multinomial(weights, 1, generator=generator)))
        return run
    run.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return run
