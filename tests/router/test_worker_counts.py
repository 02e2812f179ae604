"""A worker's counts as this router keeps them (WorkerHandle, no Ray): a prompt placed
whole on a worker is queued there until its first token and only then in flight, so
the policy's load (queued prompts beside the requests holding a slot past their
prompt) counts it once. Counted in both, each queued prompt took two of the
worker's max_num_seqs slots in the forecast of when a new prompt is admitted."""
from __future__ import annotations

from types import SimpleNamespace

from pdserve.router.policy.latency_forecast import slots_short
from pdserve.router.pool.workers import WorkerHandle
from pdserve.worker.messages import WorkerTelemetry


def flight(key: str):
    return SimpleNamespace(key=key, tpot_slo_s=None)  # no TPOT SLO: no budget row


def counts(handle: WorkerHandle) -> tuple[int, int]:
    return handle.state.queued, handle.state.inflight


def test_a_colocated_prompt_is_queued_until_its_first_token_then_in_flight():
    w = WorkerHandle.of("w0", client=None, role="both")
    a = flight("a")
    w.enqueue(100, a)
    w.hold(a)  # submitted: its prompt waits here
    assert counts(w) == (1, 0)
    w.unqueue(100, a)  # its first token: it decodes here now
    assert counts(w) == (0, 1)
    w.unhold(a)
    assert counts(w) == (0, 0) and not w.flights


def test_a_request_ended_while_its_prompt_waits_leaves_nothing_counted_either_way():
    w = WorkerHandle.of("w0", client=None, role="both")
    b, c = flight("b"), flight("c")
    for f in (b, c):
        w.enqueue(50, f)
        w.hold(f)
    w.unhold(b)  # released before dequeued
    w.unqueue(50, b)
    w.unqueue(50, c)  # dequeued before released
    w.unhold(c)
    assert counts(w) == (0, 0) and w.state.queued_tokens == 0 and not w.flights


def test_a_prefill_sides_prompt_is_queued_only_and_a_reservation_in_flight_only():
    w = WorkerHandle.of("w0", client=None, role="both")
    w.enqueue(70)  # computed here for another worker's decode
    w.hold(flight("d"))  # reserved here for a prompt computed elsewhere
    assert counts(w) == (1, 1)


def test_the_slot_forecast_counts_a_queued_prompt_once():
    """max_num_seqs 4; the last report: 2 running, nothing waiting. Since, this router
    placed one prompt here (queued). A new prompt is admitted with 2 + 1 + 1 = 4
    requests holding slots: none must end first."""
    w = WorkerHandle.of("w0", client=None, role="both")
    for key in ("r1", "r2"):  # the two running ones, past their prompts
        w.hold(flight(key))
    q = flight("q")
    w.enqueue(300, q)
    w.hold(q)
    report = WorkerTelemetry("w0", "both", 0.0, waiting=0, waiting_tokens=0, running=2,
                             context_tokens=0, reserved=0, free_blocks=100, num_blocks=100,
                             num_preemptions=0, token_budget=2048, max_num_seqs=4)
    w.update(telemetry=report, heard_at=0.0)
    load = w.state.reported_load
    assert (load.queued_requests, load.decode_seqs) == (1, 2)
    assert slots_short(load) == 0
