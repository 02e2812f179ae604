"""The goodput policy's shortlists, scanned as columns, against their rule written
over the workers one by one; and columns patched from the last snapshot's against
columns built afresh. Random clusters (seeded), without Ray or torch."""
from __future__ import annotations

import random
from dataclasses import fields, replace

import numpy as np
import pytest

from pdserve.engine.latency_model import DEFAULT_STEP_COST, StepCost
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState
from pdserve.router.policy.least_loaded import has_room
from pdserve.router.policy.worker_columns import _SHORTLIST, ColumnsMemo, WorkerColumns, shortlists
from pdserve.worker.messages import WorkerTelemetry

NOW = 1000.0


def a_worker(rng: random.Random, i: int) -> WorkerState:
    wid, role = f"w{i}", rng.choice(("prefill", "decode", "both"))
    # few distinct values, so the rough estimates tie often (ties go in row order)
    telemetry = None if rng.random() < 0.1 else WorkerTelemetry(
        wid, role, 0.0, waiting=rng.randrange(3), waiting_tokens=rng.choice((0, 500, 900)),
        running=rng.randrange(4), context_tokens=rng.choice((0, 4000)), reserved=0,
        free_blocks=rng.randrange(1000), num_blocks=1000, num_preemptions=0)
    cost = rng.choice((None, DEFAULT_STEP_COST, StepCost(
        base_s=0.01, prefill_token_s=2e-4, prefill_pair_s=0.0, decode_seq_s=0.002,
        decode_context_s=1e-7)))
    return WorkerState(wid, role, alive=rng.random() > 0.1, silent=rng.random() < 0.05,
                       draining=rng.random() < 0.1, queued=rng.randrange(3),
                       queued_tokens=rng.choice((0, 300, 700)), inflight=rng.randrange(5),
                       others_queued_tokens=rng.choice((0, 0, 400)), telemetry=telemetry,
                       heard_at=NOW, num_blocks=1000, step_cost=cost)


def a_request(rng: random.Random, workers) -> RequestView:
    ids = [w.worker_id for w in workers] + ["gone"]  # a worker no longer here
    refused = frozenset(rng.sample(ids, rng.randrange(4)))
    cached = {w: rng.choice((16, 320, 640)) for w in rng.sample(ids, rng.randrange(6))}
    n = rng.choice((100, 700, 1200))
    return RequestView(n, -(-(n + 1) // 16), refused=refused, cached_tokens=cached)


def by_the_rule(request: RequestView, state: ClusterState):
    """The shortlists written over the workers one by one."""
    n, cached = request.num_prompt_tokens, request.cached_tokens
    decoders = [w for w in state.workers if w.available and w.decodes
                and w.worker_id not in request.refused]
    prefillers = [w for w in state.workers if w.available and w.sends_kv(state.adaptive)
                  and has_room(w, request, state)]
    if len(decoders) > _SHORTLIST:
        decoders = sorted(decoders, key=lambda w: w.rough()[0])[:_SHORTLIST]
    if len(prefillers) > _SHORTLIST:
        def rough(w):
            _, per_token, queued = w.rough()
            return per_token * (queued + n - cached.get(w.worker_id, 0))
        prefillers = sorted(prefillers, key=rough)[:_SHORTLIST]
    return decoders, prefillers


@pytest.mark.parametrize("size", [5, 17, 60, 400])
def test_the_shortlists_follow_their_rule_as_the_cluster_changes(size):
    rng = random.Random(size)
    workers = [a_worker(rng, i) for i in range(size)]
    memo, checked = ColumnsMemo(), 0
    for _ in range(40):
        # some workers report (a new state), some leave, some join; the order moves
        for i in rng.sample(range(len(workers)), rng.randrange(len(workers) // 3 + 1)):
            workers[i] = replace(a_worker(rng, i), worker_id=workers[i].worker_id)
        if rng.random() < 0.2:
            workers.pop(rng.randrange(len(workers)))
            workers.append(a_worker(rng, size + checked))
        if rng.random() < 0.1:
            rng.shuffle(workers)
        config = RouterConfig(adaptive=rng.random() < 0.5,
                              max_queued_prefill_tokens=rng.choice((0, 1000, 2000)))
        state = ClusterState(tuple(workers), NOW, config, ModelInfo("m", 4096, 1000, 16),
                             columns_memo=memo)
        for _ in range(3):
            request = a_request(rng, workers)
            assert shortlists(request, state) == by_the_rule(request, state)
            checked += 1
    assert checked == 120


def test_patched_columns_equal_columns_built_afresh():
    rng = random.Random(7)
    workers = tuple(a_worker(rng, i) for i in range(50))
    last = WorkerColumns.of(workers, adaptive=True)
    for step in range(30):
        changed = list(workers)
        for i in rng.sample(range(50), rng.randrange(1, 8)):
            changed[i] = replace(a_worker(rng, i), worker_id=f"w{i}" if step % 2 else f"x{i}")
        workers = tuple(changed)
        patched, fresh = WorkerColumns.of(workers, True, last), WorkerColumns.of(workers, True)
        assert patched.states is workers and patched.index == fresh.index
        for f in fields(WorkerColumns):
            if isinstance(getattr(fresh, f.name), np.ndarray):
                assert np.array_equal(getattr(patched, f.name), getattr(fresh, f.name)), f.name
        last = patched
    # the same states: the same columns, nothing read again
    assert WorkerColumns.of(workers, True, last) is last


def test_the_rough_estimates_read_the_load_a_forecast_reads():
    """WorkerState.rough() builds no WorkerLoad (it is read for every worker that
    reported): the same figures as from its reported_load."""
    rng = random.Random(11)
    for i in range(300):
        w = a_worker(rng, i)
        cost, load = w.step_cost or DEFAULT_STEP_COST, w.reported_load
        assert w.rough() == (cost.base_s + cost.decode_seq_s * load.decode_seqs
                             + cost.decode_context_s * load.decode_context
                             + cost.prefill_token_s * load.queued_tokens,
                             cost.prefill_token_s, load.queued_tokens)
