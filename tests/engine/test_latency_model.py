"""The latency model's fit and forecasts, pure (no torch, no Ray)."""
from __future__ import annotations

import random
from dataclasses import astuple

import numpy as np
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.latency_model import (
    OnlineFit,
    PromptShare,
    StepCost,
    StepModel,
    TransferCost,
    TransferModel,
)
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput
from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.engine.telemetry import report
from pdserve.router.policy.latency_forecast import (
    WorkerLoad,
    prompt_pairs,
    slots_short,
    tpot_seconds,
    ttft_seconds,
)

TRUE = StepCost(base_s=3e-3, prefill_token_s=4e-5, prefill_pair_s=2e-8,
                decode_seq_s=6e-4, decode_context_s=2e-7)


def synthetic_steps(cost: StepCost, n: int, noise: float, rng: random.Random):
    """Mixed steps as a worker in role both runs them: decodes, chunks, both."""
    out = []
    for _ in range(n):
        prefill = rng.choice([0, 0, rng.randint(1, 2048)])
        computed = rng.randint(0, 4096) if prefill else 0
        pairs = prefill * computed + prefill * (prefill + 1) // 2
        seqs = rng.randint(0 if prefill else 1, 64)
        context = seqs * rng.randint(16, 4096)  # the batch's mean KV length varies
        shape = StepShape(prefill, pairs, seqs, context)
        duration = cost.duration(shape) * (1 + rng.gauss(0, noise))
        out.append(StepTiming(shape, duration, 0.0))
    return out


def test_the_fit_recovers_known_coefficients_within_5_percent():
    rng = random.Random(7)
    model = StepModel(prior=StepCost(1e-2, 1e-4, 0.0, 1e-3, 0.0))  # a wrong prior
    model.observe(synthetic_steps(TRUE, 512, noise=0.03, rng=rng))
    fitted = model.cost()
    for name, got, want in zip(StepCost.__dataclass_fields__, astuple(fitted), astuple(TRUE)):
        assert got == pytest.approx(want, rel=0.05), name


def test_a_term_the_window_never_saw_keeps_its_prior():
    prior = StepCost(5e-3, 5e-5, 1e-8, 3e-4, 1e-7)
    model = StepModel(prior=prior)
    rng = random.Random(1)
    decodes = [t for t in synthetic_steps(TRUE, 600, noise=0.02, rng=rng)
               if t.shape.prefill_tokens == 0]
    model.observe(decodes)
    fitted = model.cost()
    assert fitted.prefill_token_s == pytest.approx(prior.prefill_token_s)
    assert fitted.prefill_pair_s == pytest.approx(prior.prefill_pair_s)
    assert fitted.decode_seq_s == pytest.approx(TRUE.decode_seq_s, rel=0.05)


def test_the_window_follows_a_worker_that_got_slower():
    rng = random.Random(3)
    model = StepModel(window=256)
    model.observe(synthetic_steps(TRUE, 256, noise=0.02, rng=rng))
    slower = StepCost(*(2 * c for c in astuple(TRUE)))
    model.observe(synthetic_steps(slower, 256, noise=0.02, rng=rng))
    assert model.cost().base_s == pytest.approx(slower.base_s, rel=0.05)


def _ridge_lstsq(fit: OnlineFit, samples: list[tuple[list[float], float]]) -> np.ndarray:
    """The rule, stacked and solved by numpy's least squares: rows over their own
    durations, scaled to unit RMS, pulled toward the prior, clipped at zero."""
    x = np.array([s[0] for s in samples]) / np.array([[max(s[1], 1e-6)] for s in samples])
    y = np.array([s[1] / max(s[1], 1e-6) for s in samples])
    scale = np.sqrt((x * x).mean(axis=0))
    scale[scale == 0] = 1.0
    ridge = np.sqrt(fit.strength * len(y))
    k = len(fit.prior)
    v, *_ = np.linalg.lstsq(np.vstack([x / scale, ridge * np.eye(k)]),
                            np.concatenate([y, ridge * fit.prior * scale]), rcond=None)
    return np.maximum(v / scale, 0.0)


def test_the_fit_is_the_ridge_least_squares_over_the_samples_still_in_the_window():
    """The ring of samples (wrapping, aged out from its head, refilled) against the
    rule solved from a plain list of what should be in it (to 1e-4: a zero duration
    weighs its row a million times, and the normal equations square its condition)."""
    rng = random.Random(11)
    for trial in range(40):
        window, max_age = rng.randint(3, 80), rng.choice([None, 2.0, 10.0])
        prior = [rng.uniform(0, 1e-3) for _ in range(6)]
        fit = OnlineFit(prior, window=window, max_age_s=max_age)
        kept: list[tuple[list[float], float, float]] = []
        now = 0.0
        for _ in range(rng.randint(1, 300)):
            now += rng.expovariate(10.0)
            x = [1.0, *(rng.randint(0, 4000) * (rng.random() < 0.5) for _ in range(5))]
            y = rng.choice([0.0, rng.uniform(1e-4, 0.5), rng.uniform(1e-4, 0.5)])
            fit.add(x, y, now)
            kept = (kept + [(x, y, now)])[-window:]
            if rng.random() < 0.2:
                if max_age is not None:
                    kept = [s for s in kept if s[2] >= now - max_age]
                fit.refit_every = 1
                got = fit.coefficients(now)
                assert len(fit) == len(kept)
                want = (_ridge_lstsq(fit, [(x, y) for x, y, _ in kept]) if kept
                        else np.asarray(prior))
                assert got == pytest.approx(want, rel=1e-4, abs=1e-12), (trial, len(kept))


def test_bad_measurements_are_ignored_and_coefficients_stay_non_negative():
    model = StepModel()
    model.observe([StepTiming(StepShape(decode_seqs=1, decode_context=10), float("nan"), 0),
                   StepTiming(StepShape(decode_seqs=1, decode_context=10), -1.0, 0)])
    assert model.num_samples == 0
    # decodes that get faster with more context would fit a negative term
    model.observe([StepTiming(StepShape(decode_seqs=1, decode_context=c), 0.01 - c * 1e-6, 0)
                   for c in range(10, 5000, 50)])
    assert all(c >= 0 for c in astuple(model.cost()))


def test_the_transfer_fit_recovers_latency_and_bandwidth():
    rng = random.Random(5)
    model = TransferModel()
    true = TransferCost(latency_s=1.5e-3, per_byte_s=1 / 2.5e9)  # 2.5 GB/s
    for _ in range(200):
        nbytes = rng.randint(1 << 16, 64 << 20)
        model.observe(nbytes, true.seconds(nbytes) * (1 + rng.gauss(0, 0.03)))
    fitted = model.cost()
    assert fitted.latency_s == pytest.approx(true.latency_s, rel=0.05)
    assert fitted.per_byte_s == pytest.approx(true.per_byte_s, rel=0.05)


def test_ttft_counts_the_queue_the_chunks_and_the_decodes_carried():
    cost = StepCost(base_s=1e-3, prefill_token_s=1e-5, prefill_pair_s=0.0,
                    decode_seq_s=1e-4, decode_context_s=0.0)
    # 10 decodes leave 90 tokens a step: 300 queued + 150 new = 450 -> 5 steps, each
    # carrying base + 10 decodes (2 ms), plus 450 prompt tokens (4.5 ms)
    load = WorkerLoad(queued_tokens=300, queued_requests=2, decode_seqs=10, token_budget=100)
    assert ttft_seconds(cost, load, 150) == pytest.approx(5 * 2e-3 + 450 * 1e-5)
    # 128 of those tokens cached: 322 tokens, 4 steps
    assert ttft_seconds(cost, load, 150, cached=128) == pytest.approx(4 * 2e-3 + 322 * 1e-5)


def test_a_prompt_waits_for_as_many_requests_to_end_as_it_is_over_max_num_seqs():
    # every running request and every queued prompt holds a slot
    assert slots_short(WorkerLoad(decode_seqs=6, queued_requests=1, max_seqs=8)) == 0
    assert slots_short(WorkerLoad(decode_seqs=8, queued_requests=2, max_seqs=8)) == 3
    assert slots_short(WorkerLoad(decode_seqs=500, queued_requests=9)) == 0  # unbounded
    # and the bound is what a worker's telemetry reports of its scheduler
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 16))
    for i in range(3):
        sched.add_request(Request(f"r{i}", list(range(1, 40)), SamplingParams(), 0.0))
    sched.update(sched.schedule(), ModelRunnerOutput({"r0": 5, "r1": 5}))
    t = report("w", "both", sched, 0.0, ())
    assert (t.max_num_seqs, t.running, t.waiting) == (2, 2, 1)


def test_tpot_spreads_the_queued_prompts_over_the_output():
    cost = StepCost(base_s=1e-3, prefill_token_s=1e-5, prefill_pair_s=0.0,
                    decode_seq_s=1e-4, decode_context_s=1e-6)
    idle = WorkerLoad(decode_seqs=3, decode_context=300)
    # joined: 4 seqs over 300 + 100 + 50 context: 1 + 0.4 + 0.45 ms
    assert tpot_seconds(cost, idle, 100, 101) == pytest.approx(1.85e-3)
    busy = WorkerLoad(queued_tokens=1000, queued_requests=1, decode_seqs=3,
                      decode_context=300)
    assert tpot_seconds(cost, busy, 100, 101) == pytest.approx(1.85e-3 + 1000 * 1e-5 / 100)


def test_tpot_counts_the_prompts_still_to_arrive_at_the_recent_prompt_share():
    cost = StepCost(base_s=1e-3, prefill_token_s=1e-5, prefill_pair_s=0.0,
                    decode_seq_s=1e-4, decode_context_s=1e-6)
    # a third of every second computing prompts: 1.85 ms of its own per token / (2/3)
    shared = WorkerLoad(decode_seqs=3, decode_context=300, prompt_share=1 / 3)
    assert tpot_seconds(cost, shared, 100, 101) == pytest.approx(1.85e-3 * 1.5)
    # a worker that only computed prompts lately still decodes between them: capped
    flooded = WorkerLoad(decode_seqs=3, decode_context=300, prompt_share=1.0)
    assert tpot_seconds(cost, flooded, 100, 101) == pytest.approx(1.85e-3 * 4)


def test_the_prompt_share_is_the_prompt_part_of_recent_step_time():
    cost = StepCost(base_s=2e-3, prefill_token_s=1e-5, prefill_pair_s=0.0,
                    decode_seq_s=0.0, decode_context_s=0.0)
    share = PromptShare(window_s=10.0)
    # over 20 s, one step a second: 1,000 prompt tokens beside decodes, measured at
    # 24 ms where its cost says 12 ms, of which the prompt's 10 ms: 20 ms of it
    mixed = StepShape(prefill_tokens=1000, decode_seqs=4)
    decode = StepShape(decode_seqs=4)
    share.observe([StepTiming(decode, 0.002, 0.002)], cost)
    assert share.share(now=0.5) == 0.0  # decodes only
    share.observe([StepTiming(mixed, 0.024, float(t)) for t in (1, 2)], cost)
    assert share.share(now=2.0) == pytest.approx(2 * 0.020 / 2.0)  # 2 s seen so far
    share.observe([StepTiming(mixed, 0.024, float(t)) for t in range(3, 21)], cost)
    assert share.share(now=20.0) == pytest.approx(11 * 0.020 / 10.0)  # steps 10..20
    assert share.share(now=40.0) == 0.0  # all older than the window


def test_prompt_pairs_match_the_step_shapes_of_its_chunks():
    # 100 tokens in chunks of 30 / 30 / 40: the pairs the engine's StepShape counts
    chunks = [(30, 0), (30, 30), (40, 60)]
    assert sum(n * c + n * (n + 1) // 2 for n, c in chunks) == prompt_pairs(100)
    assert prompt_pairs(100, cached=60) == 40 * 60 + 40 * 41 // 2


def test_verification_steps_teach_the_draft_cost_and_the_tokens_a_step_yields():
    """A worker speculating: its decode steps also verify drafts and each decode gains
    more than a token a step. The fit recovers the per-draft cost; the model measures
    the yield; a TPOT forecast is the step (drafts included) over the tokens it yields,
    so it stays right with speculation on."""
    true = StepCost(base_s=3e-3, prefill_token_s=4e-5, prefill_pair_s=2e-8,
                    decode_seq_s=6e-4, decode_context_s=2e-7, draft_token_s=3e-4)
    rng = random.Random(3)
    steps = []
    for t in synthetic_steps(true, 500, noise=0.02, rng=rng):  # within the window
        s = t.shape
        drafts = rng.randint(0, 4 * s.decode_seqs) if s.decode_seqs else 0
        shape = StepShape(s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_context,
                          drafts)
        accepted = drafts // 2  # half the drafts accepted
        steps.append(StepTiming(shape, true.duration(shape) * (1 + rng.gauss(0, 0.02)), 0.0,
                                decode_tokens=s.decode_seqs + accepted))
    model = StepModel()
    model.observe(steps)
    fitted = model.cost()
    assert fitted.draft_token_s == pytest.approx(true.draft_token_s, rel=0.05)
    seqs = sum(t.shape.decode_seqs for t in steps)
    drafts = sum(t.shape.draft_tokens for t in steps)
    assert fitted.drafts_per_decode == pytest.approx(drafts / seqs)
    assert fitted.decode_yield == pytest.approx(sum(t.decode_tokens for t in steps) / seqs)
    assert 1.5 < fitted.decode_yield < 2.5  # 2 drafts a decode on average, half kept: ~2
    # 4 decodes, 2 drafts each, 1.5 tokens a step each: (1 + 0.6 + 4 x 2 x 0.3) ms / 1.5
    cost = StepCost(base_s=1e-3, prefill_token_s=0.0, prefill_pair_s=0.0, decode_seq_s=1.5e-4,
                    decode_context_s=0.0, draft_token_s=1e-4, decode_yield=1.5,
                    drafts_per_decode=2.0)
    assert tpot_seconds(cost, WorkerLoad(decode_seqs=3), 10, 11) == pytest.approx(
        (1e-3 + 4 * 1.5e-4 + 4 * 2 * 1e-4) / 1.5)
    # steps without speculation (decode_tokens unset) yield a token each
    plain = StepModel()
    plain.observe(synthetic_steps(TRUE, 50, noise=0.0, rng=rng))
    assert (plain.cost().decode_yield, plain.cost().drafts_per_decode) == (1.0, 0.0)
