"""How many workers a pool needs for an arrival rate (the planner's demand, read by
core.py: grown at the SLO, shrunk at margin x SLO), from the slowest measured step
cost among its warm workers and the traffic's mean prompt (ISL, not cached) and
output (OSL) lengths:

    prefill    kept as busy as a queue of random arrivals allows within the TTFT SLO
    decode     at steps of the TPOT SLO (Little: rate x OSL decoding at once)
    colocated  at steps of the TPOT SLO that each carry the decodes and a chunk of the
               arriving prompts, one step overhead for both; at least what its prompts
               alone need against the TTFT SLO
    KV         decoding pools also hold their decodes' KV within KV_FULL of each

Pure: figures in, a fraction of workers out (0 when unknown)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pdserve.engine.latency_model import StepCost
from pdserve.router.policy.latency_forecast import (
    WorkerLoad,
    decode_step_seconds,
    prompt_compute_seconds,
)
from pdserve.router.slo import Slo

if TYPE_CHECKING:
    from pdserve.router.planner.core import WorkerView

KV_FULL = 0.95  # a decode worker this full cannot take the next request's KV


def need(role: str, warm: list[WorkerView], slo: Slo, isl: float, osl: float,
         rate: float, margin: float, load_factor: float = 1.0) -> float:
    """Workers (a fraction) `rate` requests a second need with every worker kept
    within margin x SLO, and (decoding roles) their KV within margin x KV_FULL; 0
    when unknown (no measured worker, no traffic figures). With a load_factor each
    worker counts for that many times the load the SLO terms give it (not its KV:
    a request that finds none is refused or preempted, however the SLOs are met)."""
    if not warm or isl <= 0 or osl <= 0 or rate == 0:
        return 0.0
    cost = worst_cost(warm)
    kv = _kv_need(warm, rate, osl, margin) if role != "prefill" else 0.0
    rate = rate / load_factor  # the SLO terms' rate
    # A worker's share of time per prompt: its compute, plus the steps it spans.
    prompt_s = prompt_compute_seconds(cost, int(isl))
    per_prompt_s = prompt_s + cost.base_s * math.ceil(isl / WorkerLoad().token_budget)
    prefill = rate * per_prompt_s / _busy_share(per_prompt_s, slo.ttft_s, margin)
    if role == "prefill":
        return prefill
    if slo.tpot_s is None:  # decode sized on misses and KV alone
        return max(prefill if role == "both" else 0.0, kv)
    step_s = margin * slo.tpot_s  # the longest step the TPOT SLO allows, at the margin
    per_seq = cost.decode_seq_s + cost.decode_context_s * (isl + osl / 2)
    if step_s <= cost.base_s:  # no number of workers meets it: sized on misses
        return max(prefill if role == "both" else 0.0, kv)
    if role == "decode":
        if per_seq <= 0:  # a decode costs its step nothing: any batch fits one worker
            return kv
        seqs_per_worker = max((step_s - cost.base_s) / per_seq, 1.0)
        # Little: requests decoding at once = rate x their time decoding.
        return max(rate * osl * step_s / seqs_per_worker, kv)
    # Colocated: every step carries the running decodes and a chunk of the prompts
    # arriving; at steps of step_s a worker has step_s - base_s of each for them, so
    # r requests a second need r x (prompt + osl decode steps' worth) / (1 - base/step)
    # workers (one base a step, not one for prompts and one for decodes); and at least
    # what its prompts alone need against the TTFT SLO.
    work_s = prompt_s + per_seq * osl
    return max(rate * work_s / (1 - cost.base_s / step_s), prefill, kv)


def _kv_need(warm: list[WorkerView], rate: float, osl: float, margin: float) -> float:
    """Workers whose KV the decodes at `rate` fill to margin x KV_FULL: as many decode
    at once as arrive a second times how long each decodes (Little: OSL steps at the
    warm workers' mean step now), each holding the share of a worker's KV that a
    request decoding there holds now. 0 when none decodes (nothing to read)."""
    seqs = sum(w.load.decode_seqs for w in warm)
    if not seqs:
        return 0.0
    per_seq = sum(w.kv_used for w in warm) / seqs
    step = sum(decode_step_seconds(w.cost, w.load) for w in warm) / len(warm)
    return rate * osl * step * per_seq / (margin * KV_FULL)


def _busy_share(service_s: float, ttft_s: float | None, margin: float) -> float:
    """How busy a prefill worker may be kept and still meet margin x the TTFT SLO:
    arrivals at random, prompts of one length (M/D/1), a prompt waits on average
    rho S / 2(1 - rho) before its own S; so rho <= 2B / (S + 2B), B = margin x SLO - S.
    At most 0.95 (the queue grows without bound at 1); without a TTFT SLO, margin."""
    if ttft_s is None:
        return margin
    slack = margin * ttft_s - service_s
    if slack <= 0:
        return 0.5  # the SLO barely fits one prompt alone: keep the queue short
    return min(2 * slack / (service_s + 2 * slack), 0.95)


def worst_cost(workers: list[WorkerView]) -> StepCost:
    """The slowest measured step among them (its base plus a mid-sized prompt)."""
    return max((w.cost for w in workers),
               key=lambda c: c.base_s + 512 * c.prefill_token_s + 32 * c.decode_seq_s)
