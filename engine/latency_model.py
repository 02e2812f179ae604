"""The latency model's measurements side: how long one engine step of a worker takes
as a function of the step's shape, and how long a KV transfer from one worker to
another stays exposed, each fitted online from what the workers measured. Pure
(numpy; no torch, no Ray, no clock), so the router and a capacity simulator share it.

    step_s     = base + prefill_token * prefill_tokens + prefill_pair * prefill_pairs
                 + decode_seq * decode_seqs + decode_context * decode_context
                 + draft_token * draft_tokens
    transfer_s = latency + per_byte * bytes

Each fit is least squares over a sliding window, pulled gently toward a prior (the
worker's start-up profile, or the defaults below): a term the window never exercised
(a decode worker sees no prefill) keeps its prior value instead of an arbitrary one.
A model's window may also be bounded in age: a worker (or a pair) nobody sends work
to measures nothing, so a model that overestimates it (fitted under contention) would
refuse it work for ever; once its samples age out, its forecast is its prior again.

A worker's prompt share is what arrives after a forecast: the share of its recent
time its steps spent computing prompts. Prompts that arrive while a request decodes
there stretch that request's steps; the forecast of its TPOT counts them at the
rate they arrived lately.
With speculative decoding a decode step also verifies draft tokens (draft_tokens;
a draft model's own passes ride in the step's duration too) and a decoding request
gains more than one token per step: the step model measures, over its window, the
tokens a decode gains per step and the drafts it verifies, so that a TPOT forecast
is a step's time over the tokens it yields.
latency_forecast.py turns the costs into TTFT and TPOT predictions."""
from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass
from typing import Sequence

import numpy as np

from pdserve.engine.step_shape import StepShape, StepTiming


@dataclass(frozen=True)
class StepCost:
    """Seconds per unit of each term of a step's shape (COEFFICIENTS), and how the
    worker's decodes step (measured, not fitted)."""
    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_s: float
    draft_token_s: float = 0.0
    decode_yield: float = 1.0  # tokens a decoding request gains per step (1 + accepted)
    drafts_per_decode: float = 0.0  # draft tokens a decoding request verifies per step

    def duration(self, shape: StepShape) -> float:
        return (self.base_s + self.prefill_token_s * shape.prefill_tokens
                + self.prefill_pair_s * shape.prefill_pairs
                + self.decode_seq_s * shape.decode_seqs
                + self.decode_context_s * shape.decode_context
                + self.draft_token_s * shape.draft_tokens)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The fitted terms, in features() order."""
        return (self.base_s, self.prefill_token_s, self.prefill_pair_s, self.decode_seq_s,
                self.decode_context_s, self.draft_token_s)


@dataclass(frozen=True)
class TransferCost:
    latency_s: float
    per_byte_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + self.per_byte_s * nbytes


# Priors for a worker nothing was measured of yet: a small model on a CPU core
# (a decode step of a few ms, 20k prefill tokens/s) and a 1 GB/s link.
DEFAULT_STEP_COST = StepCost(base_s=4e-3, prefill_token_s=5e-5, prefill_pair_s=1e-8,
                             decode_seq_s=3e-4, decode_context_s=1e-7, draft_token_s=5e-5)
DEFAULT_TRANSFER_COST = TransferCost(latency_s=2e-3, per_byte_s=1e-9)


def features(shape: StepShape) -> tuple[float, ...]:
    return (1.0, shape.prefill_tokens, shape.prefill_pairs, shape.decode_seqs,
            shape.decode_context, shape.draft_tokens)


class OnlineFit:
    """y ~ x . w over the last `window` samples, minimizing relative error (timing
    noise grows with the step), pulled toward `prior` with weight `strength` per
    sample (in units where each feature's RMS is 1). Coefficients are clipped at
    zero: no term makes a step faster.

    The samples live in a ring of numpy rows, and a fit solves the ridge's normal
    equations (k x k): a router refits each worker's model about once a second, and
    with 1,000 workers numpy's lstsq over the stacked window (its conversions,
    error-state and SVD) was a seventh of a simulation's time. The ridge keeps the
    system's condition under (k + strength) / strength whatever the samples."""

    def __init__(self, prior: Sequence[float], window: int = 512, strength: float = 1e-4,
                 refit_every: int = 8, max_age_s: float | None = None,
                 min_refit_interval_s: float = 0.0):
        """max_age_s: samples older than that (by their `at`, against the `now` given
        to `coefficients`) leave the window; None: only the window's length bounds it.
        min_refit_interval_s: once the window holds enough samples, a refit waits
        this long after the last (by `now`): a worker reports every step, and a fit is
        a least-squares solve."""
        self.prior = np.asarray(prior, dtype=np.float64)
        self.strength = strength
        self.refit_every = refit_every
        self.max_age_s = max_age_s
        self.window = window
        k = len(self.prior)
        self._x = np.zeros((window, k))  # a ring: the oldest sample at _head
        self._y = np.zeros(window)
        self._at = np.zeros(window)
        self._head = 0
        self._len = 0
        self._w = self.prior.copy()
        self._unfitted = 0  # samples since the last fit
        self.min_refit_interval_s = min_refit_interval_s
        self._fitted_at = float("-inf")

    def __len__(self) -> int:
        return self._len

    def add(self, x: Sequence[float], y: float, at: float = 0.0) -> None:
        """One sample, measured at `at` (samples arrive in time order)."""
        if len(x) != len(self.prior):
            raise ValueError(f"expected {len(self.prior)} features, got {len(x)}")
        if not np.isfinite(y) or y < 0:
            return  # a clock step or a lost measurement teaches nothing
        if self._len == self.window:  # the oldest leaves
            self._head = (self._head + 1) % self.window
            self._len -= 1
        i = (self._head + self._len) % self.window
        weight = 1.0 / max(y, 1e-6)  # the row in units of its own duration
        self._x[i] = x
        self._x[i] *= weight
        self._y[i] = y * weight
        self._at[i] = at
        self._len += 1
        self._unfitted += 1

    def coefficients(self, now: float | None = None) -> np.ndarray:
        """Refitted once `refit_every` samples arrived since the last fit, or once
        samples aged out (given `now`); the prior when none is left."""
        if now is not None and self.max_age_s is not None:
            expired = 0
            while self._len and self._at[self._head] < now - self.max_age_s:
                self._head = (self._head + 1) % self.window
                self._len -= 1
                expired += 1
            if expired:
                self._unfitted = max(self._unfitted, self.refit_every)
        if not self._len:
            self._w, self._unfitted = self.prior.copy(), 0
        elif (self._unfitted and self._len < 64) or (
                self._unfitted >= self.refit_every and (
                    now is None or now - self._fitted_at >= self.min_refit_interval_s)):
            self._w = self._fit()
            self._unfitted = 0
            self._fitted_at = float("-inf") if now is None else now
        return self._w

    def _fit(self) -> np.ndarray:
        """Minimizes |z v - y|^2 + ridge^2 |v - prior * scale|^2 in scaled units (z =
        x / scale; rows already in units of their own duration), through
        (z'z + ridge^2 I) v = z'y + ridge^2 prior * scale."""
        if self._len == self.window:
            x, y = self._x, self._y
        else:
            rows = (self._head + np.arange(self._len)) % self.window
            x, y = self._x[rows], self._y[rows]
        n, k = x.shape
        gram = x.T @ x  # [k, k]
        scale = np.sqrt(gram.diagonal() / n)
        scale[scale == 0] = 1.0  # an unexercised feature: its prior stands
        ridge2 = self.strength * n
        a = gram / np.outer(scale, scale)
        a.flat[::k + 1] += ridge2
        b = (y @ x) / scale + ridge2 * self.prior * scale
        v = np.linalg.solve(a, b)
        return np.maximum(v / scale, 0.0)


class StepModel:
    """One worker's StepCost, fitted from the StepTimings its telemetry carries."""

    def __init__(self, prior: StepCost = DEFAULT_STEP_COST, window: int = 512,
                 max_age_s: float | None = None, min_refit_interval_s: float = 0.0):
        """max_age_s: steps that ended longer ago than that (on the worker's clock,
        against `cost(now)`) no longer count. min_refit_interval_s: OnlineFit's."""
        self._fit = OnlineFit(prior.coefficients, window, max_age_s=max_age_s,
                              min_refit_interval_s=min_refit_interval_s)
        self._yield = DecodeYield(prior, window, max_age_s)

    @classmethod
    def seeded(cls, timings: Sequence[StepTiming], window: int = 512,
               max_age_s: float | None = None,
               min_refit_interval_s: float = 0.0) -> "StepModel":
        """A model whose prior is the fit of `timings` (a worker's start-up profile,
        or the first steps seen of it), which it also holds as its first samples: once
        they age out, it forecasts what it measured then."""
        first = cls()
        first.observe(timings)
        model = cls(prior=first.cost(), window=window, max_age_s=max_age_s,
                    min_refit_interval_s=min_refit_interval_s)
        model.observe(timings)
        return model

    def observe(self, timings: Sequence[StepTiming]) -> None:
        for t in timings:
            self._fit.add(features(t.shape), t.duration_s, t.end_time)
        self._yield.observe(timings)

    @property
    def num_samples(self) -> int:
        return len(self._fit)

    def cost(self, now: float | None = None) -> StepCost:
        """As fitted; given `now` (the worker's clock), without the steps aged out."""
        decode_yield, drafts = self._yield.figures(now)
        return StepCost(*(float(c) for c in self._fit.coefficients(now)),
                        decode_yield=decode_yield, drafts_per_decode=drafts)


class DecodeYield:
    """What a worker's decodes gained and verified per step over its recent steps
    (the same window and age as its step fit); the prior's figures until it decoded."""

    def __init__(self, prior: StepCost, window: int = 512, max_age_s: float | None = None):
        self.prior = (prior.decode_yield, prior.drafts_per_decode)
        self.max_age_s = max_age_s
        # (end time, decoding requests, tokens they gained, drafts they verified)
        self._steps: deque[tuple[float, int, int, int]] = deque(maxlen=window)
        self._sums = [0, 0, 0]

    def observe(self, timings: Sequence[StepTiming]) -> None:
        for t in timings:
            seqs = t.shape.decode_seqs
            if not seqs:
                continue
            gained = seqs if t.decode_tokens is None else t.decode_tokens
            if len(self._steps) == self._steps.maxlen:
                self._drop()
            self._steps.append((t.end_time, seqs, gained, t.shape.draft_tokens))
            for i, v in enumerate((seqs, gained, t.shape.draft_tokens)):
                self._sums[i] += v

    def figures(self, now: float | None = None) -> tuple[float, float]:
        """(tokens a decode gains per step, drafts it verifies per step)."""
        if now is not None and self.max_age_s is not None:
            while self._steps and self._steps[0][0] < now - self.max_age_s:
                self._drop()
        seqs, gained, drafts = self._sums
        return (gained / seqs, drafts / seqs) if seqs else self.prior

    def _drop(self) -> None:
        _, *values = self._steps.popleft()
        for i, v in enumerate(values):
            self._sums[i] -= v


class TransferModel:
    """One (prefill, decode) pair's TransferCost, fitted from completed transfers:
    bytes sent, and the seconds from the last prefill step's end to the decode
    worker's confirmation (the part of the transfer the request waits for)."""

    def __init__(self, prior: TransferCost = DEFAULT_TRANSFER_COST, window: int = 256,
                 max_age_s: float | None = None):
        """max_age_s: transfers that completed longer ago than that (against
        `cost(now)`, on the clock `observe` was given) no longer count."""
        self._fit = OnlineFit(astuple(prior), window, max_age_s=max_age_s)

    def observe(self, nbytes: int, seconds: float, at: float = 0.0) -> None:
        self._fit.add((1.0, float(nbytes)), seconds, at)

    @property
    def num_samples(self) -> int:
        return len(self._fit)

    def cost(self, now: float | None = None) -> TransferCost:
        """As fitted; given `now`, without the transfers aged out."""
        return TransferCost(*(float(c) for c in self._fit.coefficients(now)))


class PromptShare:
    """The share of a worker's time over the last `window_s` (its clock) that its
    steps spent computing prompts: each step with prompt tokens counts the part of
    its duration that its cost puts on them."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._spent: deque[tuple[float, float]] = deque()  # (step end, prompt seconds)
        self._total = 0.0
        self._since: float | None = None  # when the first step seen began

    def observe(self, timings: Sequence[StepTiming], cost: StepCost) -> None:
        for t in timings:
            if self._since is None:
                self._since = t.end_time - t.duration_s
            shape = t.shape
            if not shape.prefill_tokens:
                continue
            prompt = (cost.prefill_token_s * shape.prefill_tokens
                      + cost.prefill_pair_s * shape.prefill_pairs)
            whole = cost.duration(shape)
            spent = t.duration_s * prompt / whole if whole > 0 else 0.0
            self._spent.append((t.end_time, spent))
            self._total += spent

    def share(self, now: float) -> float:
        """Prompt-computing seconds per second over the window up to `now` (over the
        time since the first step seen, but at least a second, while that is shorter)."""
        while self._spent and self._spent[0][0] < now - self.window_s:
            self._total -= self._spent.popleft()[1]
        if not self._spent or self._since is None:
            self._total = 0.0  # no float residue once empty
            return 0.0
        span = max(min(self.window_s, now - self._since), 1.0)
        return min(max(self._total, 0.0) / span, 1.0)
