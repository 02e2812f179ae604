"""The one decision point, without Ray: decide(request, ClusterState) colocates,
disaggregates or rejects; dead, draining and stalled workers and those that refused
the request are never chosen; a "full" report ranks a worker last but does not
exclude it, and a stale report is unknown, neither full nor free."""
from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState
from pdserve.router.policy.decision import Colocate, Disaggregate, Reject
from pdserve.router.policy.least_loaded import decide
from pdserve.worker.messages import WorkerTelemetry

REQ = RequestView(num_prompt_tokens=100, blocks_needed=7)


def P(wid, queued=0, tokens=0, alive=True):
    return WorkerState(wid, "prefill", alive, queued=queued, queued_tokens=tokens)


NOW = 1000.0  # the snapshot's clock
STALE_AFTER_S = 5.0


def report(wid, role, free, heard_s_ago=0.0):
    t = WorkerTelemetry(wid, role, 0.0, 0, 0, 0, 0, 0, free, 100, 0)
    return {"telemetry": t, "heard_at": NOW - heard_s_ago}


def D(wid, inflight=0, free=100, alive=True, role="decode", draining=False, heard_s_ago=0.0):
    heard = report(wid, role, free, heard_s_ago) if free is not None else {}
    return WorkerState(wid, role, alive, draining, inflight=inflight, num_blocks=100, **heard)


def state(*workers, limit=1000):
    return ClusterState(tuple(workers), NOW, RouterConfig(
        telemetry_stale_s=STALE_AFTER_S, max_queued_prefill_tokens=limit, retry_after_s=2.0))


def test_disaggregates_onto_the_least_loaded_prefill_and_decode_workers():
    decision = decide(REQ, state(P("p0", 2, 300), P("p1", 1, 100), D("d0", 3), D("d1", 1)))
    assert decision == Disaggregate("p1", "d1")


def test_the_other_replicas_requests_count_as_load_too():
    """p1 and d1 look idle to this router, but other replicas sent them more than this
    router sent p0 and d0 (shared_load.py): the least loaded are p0 and d0."""
    from dataclasses import replace
    p1 = replace(P("p1"), others_queued=3, others_queued_tokens=400)
    d1 = replace(D("d1"), others_inflight=4)
    assert decide(REQ, state(P("p0", 2, 300), p1, D("d0", 3), d1)) == Disaggregate("p0", "d0")
    assert decide(REQ, state(P("p0", 2, 300), P("p1"), D("d0", 3), D("d1"))) \
        == Disaggregate("p1", "d1")


def test_colocates_when_the_cluster_has_no_prefill_pool():
    workers = [D("e0", 2, role="both"), D("e1", 1, role="both")]
    assert decide(REQ, state(*workers)) == Colocate("e1")


def test_rejects_with_retry_after_when_every_prefill_queue_is_full():
    decision = decide(REQ, state(P("p0", 1, 950), P("p1", 2, 990), D("d0")))
    assert isinstance(decision, Reject) and decision.retry_after_s == 2.0
    assert "queue is full" in decision.reason


def test_an_empty_queue_takes_even_a_prompt_longer_than_the_limit():
    long = RequestView(num_prompt_tokens=5000, blocks_needed=320)
    assert decide(long, state(P("p0"), D("d0"))) == Disaggregate("p0", "d0")


def test_dead_workers_are_never_chosen():
    decision = decide(REQ, state(P("p0", alive=False), P("p1", 5, 500), D("d0", alive=False),
                                 D("d1", 9)))
    assert decision == Disaggregate("p1", "d1")
    assert isinstance(decide(REQ, state(P("p0", alive=False), D("d0"))), Reject)
    assert isinstance(decide(REQ, state(P("p0"), D("d0", alive=False))), Reject)
    assert isinstance(decide(REQ, state(D("e0", alive=False, role="both"))), Reject)


def test_a_worker_that_refused_the_request_is_not_asked_again():
    refused = RequestView(100, 7, refused=frozenset({"d0"}))
    assert decide(refused, state(P("p0"), D("d0"), D("d1", 5))) == Disaggregate("p0", "d1")
    everyone = RequestView(100, 7, refused=frozenset({"d0", "d1"}))
    decision = decide(everyone, state(P("p0"), D("d0"), D("d1")))
    assert isinstance(decision, Reject) and "KV" in decision.reason


def test_a_worker_last_reported_full_ranks_last_but_is_still_asked():
    assert decide(REQ, state(P("p0"), D("d0", 0, free=3), D("d1", 4))) == \
        Disaggregate("p0", "d1")
    assert decide(REQ, state(P("p0"), D("d0", 0, free=3))) == Disaggregate("p0", "d0")


def test_unknown_free_kv_is_not_taken_as_full():
    unknown = D("d0", inflight=0, free=None)
    assert decide(REQ, state(P("p0"), unknown, D("d1", 2))) == Disaggregate("p0", "d0")


def test_a_stale_report_is_unknown_not_full():
    """d0 last said "full" 6 s ago (past the 5 s bound): unknown, so it ranks by load
    like a worker never heard from, ahead of the busier d1."""
    stale_full = D("d0", inflight=0, free=3, heard_s_ago=STALE_AFTER_S + 1)
    assert decide(REQ, state(P("p0"), stale_full, D("d1", 2))) == Disaggregate("p0", "d0")
    fresh_full = D("d0", inflight=0, free=3, heard_s_ago=STALE_AFTER_S - 1)
    assert decide(REQ, state(P("p0"), fresh_full, D("d1", 2))) == Disaggregate("p0", "d1")


def test_a_stale_report_is_unknown_not_free():
    """A stale report of a nearly empty worker does not outrank a fresh one."""
    stale_free = D("d0", inflight=1, free=100, heard_s_ago=STALE_AFTER_S + 1)
    fresh = D("d1", inflight=1, free=50)
    assert decide(REQ, state(P("p0"), stale_free, fresh)) == Disaggregate("p0", "d1")


def test_draining_workers_take_nothing_new():
    assert decide(REQ, state(P("p0"), D("d0", draining=True), D("d1", 9))) == \
        Disaggregate("p0", "d1")
    draining_prefill = WorkerState("p0", "prefill", draining=True)
    decision = decide(REQ, state(draining_prefill, D("d0")))
    assert isinstance(decision, Reject) and "prefill" in decision.reason
    decision = decide(REQ, state(D("e0", role="both", draining=True)))
    assert isinstance(decision, Reject)


def test_a_mixed_cluster_decodes_on_workers_of_role_both_too():
    assert decide(REQ, state(P("p0"), D("d0", 5), D("e0", 1, role="both"))) == \
        Disaggregate("p0", "e0")
