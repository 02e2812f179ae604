"""The rejection sampler keeps the target's distribution, tested as vLLM tests its own:
the empirical distribution of the emitted tokens, over more and more seeded draws,
must close in on the target distribution much faster than on random reference
distributions. For deterministic drafts (the engine's: through Sampler.verify, each
position drawn as plain decoding draws it) and for drafts sampled from a distribution
q (rejection_sampler.rejection_sample). Greedy verification keeps drafts while they
equal the target's argmax."""
from __future__ import annotations

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.rejection_sampler import rejection_sample

VOCAB, K = 10, 2
SAMPLE_SIZES = (100, 1000, 10_000)


def _distributions(seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(VOCAB, generator=g)
    target /= target.sum()
    draft = torch.rand(VOCAB, generator=g)
    draft /= draft.sum()
    references = torch.rand(100, VOCAB, generator=g)
    return target, draft, references / references.sum(1, keepdim=True), g


def _emitted(draw, n: int) -> torch.Tensor:
    """The empirical distribution of every token n verifications emitted."""
    counts = torch.zeros(VOCAB)
    for _ in range(n):
        for token in draw():
            counts[token] += 1
    return counts / counts.sum()


def _closes_in_on_the_target(target, references, estimate) -> None:
    to_target, to_references = [], []
    for n in SAMPLE_SIZES:
        empirical = estimate(n)
        to_target.append(torch.dist(target, empirical).item())
        to_references.append((references - empirical).norm(dim=1).mean().item())
    gain_target = to_target[0] / to_target[-1]  # about sqrt(100) = 10 when unbiased
    gain_references = to_references[0] / to_references[-1]  # about 1: they stay apart
    assert gain_target > 4 * gain_references, (to_target, to_references)


def test_deterministic_drafts_keep_the_target_distribution():
    """The engine's path: one draft per position (greedy, or drawn from q and then
    fixed), each row sampled by the request's sampler; kept while equal."""
    for seed, greedy_drafts in ((0, True), (1, False)):
        target, q, references, g = _distributions(seed)
        sampler = Sampler(seed)
        request = Request("r", [1, 2, 3], SamplingParams(temperature=1.0), 0.0)
        logits = target.log().expand(K + 1, VOCAB).contiguous()

        def draw():
            drafts = ([int(q.argmax())] * K if greedy_drafts
                      else torch.multinomial(q, K, replacement=True, generator=g).tolist())
            return sampler.verify(logits, request, drafts)[0]
        _closes_in_on_the_target(target, references, lambda n: _emitted(draw, n))


def test_sampled_drafts_keep_the_target_distribution():
    """vLLM's rule for drafts sampled from q: accept with min(1, p/q), else draw the
    recovered distribution norm(max(p - q, 0)); a bonus token after k accepted."""
    for seed, same in ((2, False), (3, True)):  # q apart from p, and q equal to p
        target, q, references, g = _distributions(seed)
        q = target.clone() if same else q
        targets, drafts_q = target.expand(K + 1, VOCAB), q.expand(K, VOCAB)

        def draw():
            drafts = torch.multinomial(q, K, replacement=True, generator=g).tolist()
            return rejection_sample(targets, drafts, drafts_q, g)
        _closes_in_on_the_target(target, references, lambda n: _emitted(draw, n))


def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    sampler = Sampler(0)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0), 0.0)
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 4, 1]):
        logits[row, best] = 5.0
    assert sampler.verify(logits, request, [3, 1, 4])[0] == [3, 1, 4, 1]  # all + bonus
    assert sampler.verify(logits, request, [3, 2, 4])[0] == [3, 1]  # second rejected
    assert sampler.verify(logits, request, [7, 1, 4])[0] == [3]


def test_seeded_verification_is_reproducible():
    """The same seed, drafts and logits give the same run, whichever sampler."""
    logits = torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(4))
    request = Request("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=11), 0.0)
    runs = {tuple(Sampler(s).verify(logits, request, [1, 2])[0]) for s in range(5)}
    assert len(runs) == 1
