"""The goodput policy: for one request, every way to run it is forecast with the
latency model, and the one chosen meets the request's SLOs while costing the
requests already running the least.

Candidates: colocate on each worker in role both; each (P, D) pair of a worker that
prefills for others (role prefill, or both in adaptive mode) and another that
decodes. For each, from the workers' fitted step costs and loads:

    TTFT  = P's queue ahead + this prompt's uncached tokens, chunked as the scheduler
            chunks, each step carrying P's running decodes, and not before a sequence
            slot frees where max_num_seqs requests run (the scheduler admits no
            prompt then) (+ for a pair: the exposed KV transfer of the blocks D does
            not hold)
    TPOT  = a step of D's decode batch with this request in it, plus the prompt work
            queued on D spread over this request's output, stretched by the
            prompts still to come there (D's recent prompt share)
    harm  = per running request on D: each step longer by the join; on a worker that
            computes the prompt (colocated, or a P in role both): its decodes stall
            for the prompt's compute, spread over their remaining tokens. Requests
            placed there still waiting for their first token are protected as
            running ones, not priced

A candidate fits when its TTFT is within the headroom of this request's TTFT SLO
(RoutingSpec.ttft_headroom: placed at the forecast's edge, a request misses about as
often as not and lengthens the queue behind it), its TPOT meets its SLO, and no running
request of the same or a more important priority that is on track is pushed past
its TPOT SLO: past what it expects per token without this request (D's step
stretched by the prompts still to come, and the prompts queued there spread over
its remaining tokens). Among those that fit the cheapest wins: its own latencies
as shares of its SLOs plus the shares of their SLOs it takes from the others. So
colocating or disaggregating is decided by comparing forecasts, with no length
threshold.
When none fits: admission "slo" refuses (429) with the predicted time until one
would (the router waits instead while capacity may still free in time for the
request's TTFT), admission "always" (and a best-effort request) takes the least
bad. A TTFT SLO that no candidate could meet were its workers idle is refused as
"unattainable" (the router answers 400 naming slo_ttft_ms: a retry cannot help;
docs/goodput.md). Pure."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.engine.block_manager import blocks_for
from pdserve.router.policy.cluster_state import NO_BUDGETS, ClusterState, RequestView, WorkerState
from pdserve.router.policy.decision import Colocate, Decision, Disaggregate, Reject
from pdserve.router.policy.latency_forecast import (
    WorkerLoad,
    decode_step_seconds,
    joining_slowdown,
    prompt_compute_seconds,
    queue_compute_seconds,
    slots_short,
    tpot_seconds,
    ttft_seconds,
    with_prompts_to_come,
)
from pdserve.router.policy.worker_columns import shortlists

# SLO shares for a request without one: costs stay comparable across candidates.
_REFERENCE_TTFT_S = 1.0
_REFERENCE_TPOT_S = 0.05
_MAX_RETRY_AFTER_S = 60.0
_IDLE = WorkerLoad()  # nothing queued, nothing running
_MIN_RETRY_AFTER_S = 0.05


@dataclass(slots=True)  # not frozen: dozens are made per decision, each field set once
class Forecast:
    kind: type[Colocate | Disaggregate]  # its decision's, made when asked (one is)
    names: tuple[str, ...]  # its workers: the worker, or the prefill and decode sides
    ttft_s: float
    tpot_s: float
    cost: float  # SLO shares: its own latencies plus what it takes from the others
    miss: str = ""  # "" fits; else ttft | tpot | harm | kv
    retry_after_s: float = 0.0  # when missing: the predicted time until it would fit
    # What its TTFT would be were its workers idle, computed only when asked (when
    # nothing fits): the computing side, the KV transfer's seconds, the calibration.
    computes: "_Side | None" = None
    transfer_s: float = 0.0
    ttft_scale: float = 1.0
    tpot_scale: float = 1.0

    @property
    def decision(self) -> Colocate | Disaggregate:
        return self.kind(*self.names, self.ttft_s, self.tpot_s, ttft_scale=self.ttft_scale,
                         tpot_scale=self.tpot_scale)

    @property
    def idle_ttft_s(self) -> float:
        """The prompt alone (and the KV transfer), from placement, calibrated as
        ttft_s is."""
        return (self.computes.idle_ttft + self.transfer_s) * self.ttft_scale


def decide(request: RequestView, state: ClusterState) -> Decision:
    forecasts = candidates(request, state)
    if not forecasts:
        return Reject("no worker can take this request now", state.retry_after_s)
    fits = [f for f in forecasts if not f.miss]
    if fits:
        return min(fits, key=_rank).decision
    placeable = [f for f in forecasts if f.miss != "kv"] or forecasts
    if state.admission == "always" or request.slo.best_effort:
        return min(placeable, key=_rank).decision
    slo = request.slo
    idle_best = min(f.idle_ttft_s for f in placeable)
    if not slo.ttft_met(idle_best):
        return Reject(f"slo_ttft_ms {slo.ttft_s * 1e3:g} cannot be met here: even on an "
                      f"idle worker this prompt's first token is forecast at "
                      f"{idle_best * 1e3:.0f} ms", 0.0, "unattainable", idle_best)
    best = min(placeable, key=lambda f: (f.retry_after_s, f.cost))
    return Reject(_REASONS[best.miss].format(ttft=best.ttft_s * 1e3, tpot=best.tpot_s * 1e3),
                  min(max(best.retry_after_s, _MIN_RETRY_AFTER_S), _MAX_RETRY_AFTER_S),
                  best.miss, best.ttft_s)


_REASONS = {
    "ttft": "no worker can meet this request's TTFT SLO now with the headroom a placement "
            "keeps (best predicted {ttft:.0f} ms)",
    "tpot": "no worker can meet this request's TPOT SLO now (best predicted {tpot:.1f} ms)",
    "harm": "admitting this request would push running requests past their TPOT SLO",
    "kv": "no decode worker has room for this request's KV",
}


def _rank(f: Forecast):
    return (f.miss == "kv", f.cost, f.ttft_s, f.names)


# Pairs forecast at most: beyond it, the best prefill and decode sides alone are paired.
_MAX_PAIRS = 64


def candidates(request: RequestView, state: ClusterState) -> list[Forecast]:
    adaptive = state.adaptive
    decoders, prefillers = shortlists(request, state)
    sides: dict[str, _Side] = {}
    for w in decoders + prefillers:
        if w.worker_id not in sides:
            sides[w.worker_id] = _Side(request, state, w)
    out = [_colocate(request, state, sides[w.worker_id]) for w in decoders if w.role == "both"]
    if len(prefillers) * len(decoders) > _MAX_PAIRS:
        keep = int(_MAX_PAIRS ** 0.5)
        prefillers = sorted(prefillers, key=lambda w: sides[w.worker_id].ttft)[:keep]
        decoders = sorted(decoders, key=lambda w: sides[w.worker_id].tpot)[:keep]
    for p in prefillers:
        out += [_pair(request, state, sides[p.worker_id], sides[d.worker_id]) for d in decoders
                if d is not p and (adaptive or d.role == "decode" or p.role == "prefill")]
    return out


class _once:  # a decorator, named as cached_property is
    """cached_property without its lock (Python 3.11 takes an RLock on every first
    read: a few us, and a decision makes about 80 first reads)."""

    def __init__(self, fn):
        self.fn, self.name = fn, fn.__name__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)  # later reads find it there
        return value


class _Side:
    """One worker's part in any placement of the request: each figure forecast once per
    decision, when a placement first reads it (of a shortlist's sides, the pairs kept
    read some figures only)."""

    def __init__(self, request: RequestView, state: ClusterState, w: WorkerState):
        self.w, self._request, self._state = w, request, state
        self._cost, self.load = state.step_cost(w), state.load(w)
        self.cached = request.cached_tokens.get(w.worker_id, 0)
        self.host_load_s = request.host_load_s.get(w.worker_id, 0.0)  # of those, from host
        self.decode_seqs = self.load.decode_seqs
        self._harms: dict[tuple[bool, bool], _Harm] = {}

    @_once
    def ttft(self) -> float:
        """Computing the prompt here, from now: behind the queued prompts, and not
        before a slot frees when max_num_seqs requests run here (slot_wait)."""
        r = self._request
        queued = ttft_seconds(self._cost, self.load, r.num_prompt_tokens, self.cached) \
            + self.host_load_s
        if not self.slot_wait:
            return queued
        return max(queued, self.slot_wait + self.idle_ttft)

    @_once
    def slot_wait(self) -> float:
        """Until enough of the requests running here have ended for the scheduler to
        admit the prompt (slots_short): the k-th of this router's timed requests to
        end, each at its expected pace. inf when more must end than this router
        knows of (best-effort requests, another router's)."""
        short = slots_short(self.load)
        if not short:
            return 0.0
        ends = self.budgets.in_batch(self.budgets.remaining)
        if short > len(ends):
            return math.inf
        pace = with_prompts_to_come(self.step, self.load)
        return float(np.partition(ends, short - 1)[short - 1]) * pace

    @_once
    def tpot(self) -> float:
        """Decoding it here."""
        r = self._request
        return tpot_seconds(self._cost, self.load, r.num_prompt_tokens, r.max_tokens)

    @_once
    def step(self) -> float:
        """Its decode batch's step now."""
        return decode_step_seconds(self._cost, self.load)

    @_once
    def queued_stall(self) -> float:
        """What the prompts queued here add to its decodes' steps, in all."""
        return queue_compute_seconds(self._cost, self.load)

    @_once
    def budgets(self):
        """This router's timed requests running here."""
        return self._state.budgets.get(self.w.worker_id, NO_BUDGETS)

    @_once
    def kv_short(self) -> bool:
        """Too few free blocks (as last reported) to decode the request here."""
        free = self._state.free_blocks(self.w)
        return free is not None and free < self._request.blocks_needed

    @_once
    def idle_ttft(self) -> float:
        """Computing the prompt here with nothing queued or running."""
        return ttft_seconds(self._cost, _IDLE, self._request.num_prompt_tokens,
                            self.cached) + self.host_load_s

    @_once
    def sends(self) -> tuple[float, "_Harm | None"]:
        """As a pair's prefill side: its TTFT calibration, and what computing the
        prompt takes from its own decodes (None: it runs none)."""
        return (self.w.calibration.factor("ttft", "disaggregate"),
                self.harm(joins=False, computes=True) if self.w.decodes else None)

    @_once
    def receives(self) -> tuple[float, float, int, "_Harm"]:
        """As a pair's decode side: its calibrated TPOT and the calibration, the bytes
        of the prompt's blocks it does not hold (they are sent; its own hits stay),
        what joining its batch takes from its decodes."""
        scale = self.w.calibration.factor("tpot", "disaggregate")
        state = self._state
        prompt_blocks = blocks_for(self._request.num_prompt_tokens, state.block_size)
        blocks_sent = max(prompt_blocks - self.cached // state.block_size, 0)
        return (self.tpot * scale, scale, blocks_sent * state.kv_bytes_per_block,
                self.harm(joins=True, computes=False))

    def harm(self, joins: bool, computes: bool) -> "_Harm":
        """What the placement takes from the requests running here (the same for every
        pair this side is in: computed once)."""
        harm = self._harms.get((joins, computes))
        if harm is None:
            cost, n = self._cost, self._request.num_prompt_tokens
            harm = self._harms[joins, computes] = _Harm(
                self._request, self, joining_slowdown(cost, n) if joins else 0.0,
                prompt_compute_seconds(cost, n, self.cached) if computes else 0.0)
        return harm


def _colocate(request: RequestView, state: ClusterState, w: _Side) -> Forecast:
    ttft_scale = w.w.calibration.factor("ttft", "colocate")
    tpot_scale = w.w.calibration.factor("tpot", "colocate")
    return _forecast(Colocate, (w.w.worker_id,), request, state, w.ttft * ttft_scale,
                     w.tpot * tpot_scale, (w.harm(joins=True, computes=True),), w, w, 0.0,
                     ttft_scale, tpot_scale)


def _pair(request: RequestView, state: ClusterState, p: _Side, d: _Side) -> Forecast:
    ttft_scale, p_harm = p.sends
    tpot, tpot_scale, bytes_sent, d_harm = d.receives
    transfer = state.transfer_cost(p.w.worker_id, d.w.worker_id).seconds(bytes_sent)
    return _forecast(Disaggregate, (p.w.worker_id, d.w.worker_id), request, state,
                     (p.ttft + transfer) * ttft_scale, tpot,
                     (d_harm, p_harm) if p_harm is not None else (d_harm,), d, p, transfer,
                     ttft_scale, tpot_scale)


class _Harm:
    """What placing the request on one worker takes from the requests running there:
    each of their steps gets per_step_s longer, and they wait stall_s once (spread
    over their remaining tokens)."""

    def __init__(self, request: RequestView, side: _Side, per_step_s: float, stall_s: float):
        self.cost = 0.0  # shares of their TPOT SLOs
        # When the last on-track request it would push past its SLO (none of a lower
        # priority) will have finished, at the worker's step now; None: it breaks none.
        self.breaks_until: float | None = None
        if not per_step_s and not stall_s:
            return
        b = side.budgets
        if len(b):
            added = per_step_s + stall_s / np.maximum(b.remaining, 1) if stall_s \
                else per_step_s  # joining a batch, computing nothing: the same for each
            shares = added / np.maximum(b.allowance_s, 1e-6)
            # The cost: the batch there now (those waiting to join it are protected
            # below, not priced: pricing them pulled a split's pairs off their best
            # prefill sides, 0.96 -> 0.89 attainment on azure-code at TPOT 25 ms).
            self.cost += float(np.sum(b.in_batch(shares)))
            # Their time per token from now on without this request: a step stretched
            # by the prompts still to come, and the prompts queued there once, spread
            # over what they have left.
            step = with_prompts_to_come(side.step, side.load)
            expected = step + side.queued_stall / np.maximum(b.remaining, 1)
            on_track = b.allowance_s >= step
            broken = on_track & (expected + added > b.allowance_s) \
                & (b.priority <= request.priority)
            if broken.any():
                self.breaks_until = float(b.remaining[broken].max()) * side.step
        # best effort, or another router's (those waiting here are not in its batch)
        others = max(side.decode_seqs - (len(b) - b.num_waiting), 0)
        if others:
            self.cost += others * (per_step_s + stall_s / max(request.max_tokens, 1)) \
                / _REFERENCE_TPOT_S


def _forecast(kind: type[Colocate | Disaggregate], names: tuple[str, ...],
              request: RequestView, state: ClusterState, ttft: float, tpot: float,
              harms: tuple[_Harm, ...], decodes: _Side, computes: _Side, transfer_s: float,
              ttft_scale: float, tpot_scale: float) -> Forecast:
    """ttft: from now; the forecast's, and its decision's, count from the request's
    arrival."""
    slo = request.slo
    ttft, from_now = request.waited_s + ttft, ttft
    harm, breaks_until = 0.0, None
    for h in harms:
        harm += h.cost
        if h.breaks_until is not None and (breaks_until is None
                                           or h.breaks_until > breaks_until):
            breaks_until = h.breaks_until
    cost = (ttft / (slo.ttft_s or _REFERENCE_TTFT_S) + tpot / (slo.tpot_s or _REFERENCE_TPOT_S)
            + harm)
    miss, retry_after = _miss(request, state, ttft, from_now, tpot, decodes, breaks_until)
    return Forecast(kind, names, ttft, tpot, cost, miss, retry_after, computes, transfer_s,
                    ttft_scale, tpot_scale)


def _miss(request: RequestView, state: ClusterState, ttft: float, from_now: float,
          tpot: float, decodes: _Side, breaks_until: float | None) -> tuple[str, float]:
    """Why the placement does not fit ("" if it does), and the predicted time until
    it would."""
    slo = request.slo
    if decodes.kv_short:
        return "kv", state.retry_after_s
    if not slo.ttft_met(ttft / state.ttft_headroom):
        # a retry arrives afresh: when the queue ahead will have drained that much
        # (unknown when it waits for requests this router does not know of)
        return "ttft", (max(from_now - slo.ttft_s * state.ttft_headroom, 0.0)
                        if math.isfinite(from_now) else state.retry_after_s)
    # A one-token request has no TPOT. And one that would decode alone is not refused
    # on its TPOT forecast: nothing could serve it faster, and only measuring it can
    # correct a model that overestimates (an idle worker reports no steps).
    if request.max_tokens > 1 and not slo.tpot_met(tpot) and decodes.decode_seqs > 0:
        return "tpot", _shrunk_enough(state, decodes, (tpot - slo.tpot_s) / tpot)
    if breaks_until is not None:  # until every request it would break has finished
        return "harm", breaks_until
    return "", 0.0


def _shrunk_enough(state: ClusterState, w: _Side, excess: float) -> float:
    """When enough of this router's requests running on w are forecast to have ended
    (each its remaining tokens at w's decode step now) for a step with the request in
    it to be `excess` (a share) shorter: the forecast TPOT is that step stretched and
    calibrated, so the share, not the seconds, carries over. The configured retry
    when its known requests are not enough."""
    per_seq = w._cost.decode_seq_s
    excess_s = excess * (w.step + per_seq)
    ends = np.sort(w.budgets.remaining)
    needed = max(1, math.ceil(excess_s / per_seq)) if per_seq > 0 else len(ends) + 1
    if len(ends) and len(ends) >= w.decode_seqs:
        needed = min(needed, len(ends))  # once all end it decodes alone: never refused
    if needed > len(ends):
        return state.retry_after_s
    return float(ends[needed - 1]) * w.step
