"""The goodput policy on hand-set models, without Ray or torch: each case's
predictions are computed by hand in its comments.

Every worker here has the same step cost unless a case says otherwise:
    step = 10 ms + 0.1 ms per prefill token + 1 ms per decode sequence
and a token budget of 2,048 per step, 16-token blocks of 1,000 bytes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdserve.engine.latency_model import StepCost, TransferCost
from pdserve.router.config import RouterConfig, RoutingSpec
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.cluster_state import ClusterState, RequestView, TpotBudgets, WorkerState
from pdserve.router.policy.decision import Colocate, Disaggregate, Reject
from pdserve.router.policy.goodput import decide
from pdserve.router.policy.latency_calibration import Calibration
from pdserve.router.policy.latency_forecast import decode_step_seconds
from pdserve.router.slo import Slo
from pdserve.worker.messages import WorkerTelemetry

COST = StepCost(base_s=0.010, prefill_token_s=1e-4, prefill_pair_s=0.0,
                decode_seq_s=0.001, decode_context_s=0.0)
FAST = TransferCost(latency_s=0.002, per_byte_s=1e-6)  # 1 MB/s: 1 ms per block
NOW = 1000.0
MS = 1e-3


def worker(wid, role, running=0, waiting_tokens=0, waiting=0, free=1000,
           heard_s_ago=0.0, inflight=0, cost=COST, prompt_share=0.0, max_num_seqs=0):
    t = WorkerTelemetry(wid, role, 0.0, waiting=waiting, waiting_tokens=waiting_tokens,
                        running=running, context_tokens=0, reserved=0, free_blocks=free,
                        num_blocks=1000, num_preemptions=0, token_budget=2048,
                        max_num_seqs=max_num_seqs)
    return WorkerState(wid, role, telemetry=t, heard_at=NOW - heard_s_ago, num_blocks=1000,
                       step_cost=cost, inflight=inflight, prompt_share=prompt_share)


def state(*workers, adaptive=False, admission="slo", transfer=None, slack=None,
          headroom=RoutingSpec.ttft_headroom):
    """slack: worker id -> its running requests' (priority, slack_s, remaining), the
    slack counted from that worker's decode step in this state."""
    config = RouterConfig(telemetry_stale_s=5.0, retry_after_s=1.0, adaptive=adaptive,
                          routing=RoutingSpec(admission=admission, ttft_headroom=headroom))
    base = ClusterState(tuple(workers), NOW, config, ModelInfo("m", 4096, 1000, 16, 1000),
                        transfer=transfer or {})
    by_id = {w.worker_id: w for w in workers}
    budgets = {wid: TpotBudgets.of((priority, slack_s + decode_step_seconds(
        base.step_cost(by_id[wid]), base.load(by_id[wid])), remaining)
        for priority, slack_s, remaining in specs)
        for wid, specs in (slack or {}).items()}
    return replace(base, budgets=budgets)


def request(tokens, slo=Slo(ttft_s=0.5, tpot_s=0.05), max_tokens=101, priority=0,
            cached=None):
    return RequestView(tokens, -(-(tokens + 1) // 16), slo=slo, priority=priority,
                       max_tokens=max_tokens, cached_tokens=cached or {})


def test_a_short_prompt_on_idle_workers_is_colocated_with_its_latencies_predicted():
    # colocate: 1 step (10 ms) + 32 tokens (3.2 ms) = 13.2 ms; a decode step of itself
    # alone = 11 ms. Splitting it would add the transfer: colocating costs less.
    decision = decide(request(32), state(worker("a", "both"), worker("b", "both"),
                                         adaptive=True))
    assert decision == Colocate("a")
    assert decision.ttft_s == pytest.approx(13.2 * MS)
    assert decision.tpot_s == pytest.approx(11 * MS)


def on_track(n, slack_s=0.003, remaining=20, priority=0):
    return [(priority, slack_s, remaining)] * n


def test_a_long_prompt_beside_a_busy_decode_batch_is_disaggregated():
    # Colocated on e, 1,000 prompt tokens stall e's 8 decodes for 100 ms, 5 ms over
    # each one's 20 remaining tokens, +1 ms for the join: past their 3 ms slack.
    # Prefilled on p, they only feel the join (1 ms): that fits.
    busy = worker("e", "both", running=8)
    decision = decide(request(1000), state(worker("p", "prefill"), busy,
                                           transfer={("p", "e"): FAST},
                                           slack={"e": on_track(8)}))
    assert decision == Disaggregate("p", "e")
    # p idle: 1 step (10 ms) + 1,000 tokens (100 ms); + 63 blocks sent: 2 + 63 ms
    assert decision.ttft_s == pytest.approx((110 + 65) * MS)
    assert decision.tpot_s == pytest.approx((10 + 9) * MS)  # 9 decodes on e


def test_the_same_prompt_is_colocated_when_nothing_runs_there():
    idle = worker("e", "both")
    decision = decide(request(1000), state(worker("p", "prefill"), idle,
                                           transfer={("p", "e"): FAST}))
    assert decision == Colocate("e")  # 110 ms beats 175 ms, and nobody is harmed


def test_transfer_time_flips_the_choice_of_decode_worker():
    # d0 runs one request fewer (a 1 ms shorter step), but its link is slow:
    # 200 ms + 7 blocks against 2 ms + 7 blocks
    slow = TransferCost(latency_s=0.2, per_byte_s=1e-6)
    s = state(worker("p", "prefill"), worker("d0", "decode", running=2),
              worker("d1", "decode", running=3),
              transfer={("p", "d0"): slow, ("p", "d1"): FAST})
    decision = decide(request(100), s)
    assert decision == Disaggregate("p", "d1")
    assert decision.ttft_s == pytest.approx((10 + 10 + 2 + 7) * MS)
    # with equal links, the lighter batch wins
    even = state(*s.workers, transfer={("p", "d0"): FAST, ("p", "d1"): FAST})
    assert decide(request(100), even) == Disaggregate("p", "d0")


def test_a_prefix_hit_on_one_prefill_worker_wins():
    s = state(worker("p0", "prefill"), worker("p1", "prefill"), worker("d", "decode"),
              transfer={("p0", "d"): FAST, ("p1", "d"): FAST})
    hit = request(1024, cached={"p1": 960})
    decision = decide(hit, s)
    assert decision == Disaggregate("p1", "d")
    # 64 tokens to compute (6.4 ms) + 1 step; all 64 blocks sent (d holds none)
    assert decision.ttft_s == pytest.approx((10 + 6.4 + 2 + 64) * MS)


def test_a_host_tier_hit_is_priced_at_its_load_time():
    """p1 holds the prefix on its device, p0 in its host tier: both skip computing it,
    p0 pays loading its 60 blocks (0.5 ms each here), so p1 wins; with a load slower
    than computing the prefix, no hit at all (p2) beats p0's."""
    s = state(worker("p0", "prefill"), worker("p1", "prefill"), worker("d", "decode"),
              transfer={("p0", "d"): FAST, ("p1", "d"): FAST})
    both = RequestView(1024, 65, slo=Slo(ttft_s=0.5, tpot_s=0.05), max_tokens=101,
                       cached_tokens={"p0": 960, "p1": 960}, host_load_s={"p0": 60 * 0.5 * MS})
    assert decide(both, s) == Disaggregate("p1", "d")
    alone = replace(both, cached_tokens={"p0": 960}, host_load_s={"p0": 60 * 0.5 * MS})
    decision = decide(alone, s)
    assert decision == Disaggregate("p0", "d")
    # 64 tokens computed (6.4 ms) + 1 step + 30 ms of loads; 64 blocks sent
    assert decision.ttft_s == pytest.approx((10 + 6.4 + 30 + 2 + 64) * MS)
    slow = replace(alone, host_load_s={"p0": 60 * 2 * MS})  # 120 ms > 96 ms to compute
    assert decide(slow, s) == Disaggregate("p1", "d")


def test_the_decode_workers_own_hits_are_not_transferred():
    s = state(worker("p", "prefill"), worker("d0", "decode"), worker("d1", "decode"),
              transfer={("p", "d0"): FAST, ("p", "d1"): FAST})
    decision = decide(request(1024, cached={"d1": 960}), s)
    assert decision == Disaggregate("p", "d1")
    assert decision.ttft_s == pytest.approx((10 + 102.4 + 2 + 4) * MS)  # 4 blocks sent


def test_an_admission_that_would_push_running_requests_past_their_tpot_is_rejected():
    # 100 tokens stall e's 8 decodes 10 ms over their 40 or 60 remaining (0.25 or
    # 0.17 ms) + 1 ms join > 0.5 ms of slack. The last of them finishes in 60 steps
    # of 18 ms: only then would it harm none.
    e = worker("e", "both", running=8)
    slack = {"e": on_track(4, slack_s=0.0005, remaining=40)
             + on_track(4, slack_s=0.0005, remaining=60)}
    decision = decide(request(100), state(e, slack=slack))
    assert isinstance(decision, Reject) and decision.kind == "harm"
    assert decision.retry_after_s == pytest.approx(60 * 18 * MS)
    assert "past their TPOT SLO" in decision.reason
    # admission "always" places it anyway; so does a best-effort request
    assert decide(request(100), state(e, admission="always", slack=slack)) == Colocate("e")
    assert decide(request(100, slo=Slo()), state(e, slack=slack)) == Colocate("e")


def test_prompts_already_queued_on_a_worker_count_against_its_decodes_slack():
    # Alone, 100 tokens take e's 8 decodes 10 ms over their 20 remaining (0.5 ms) + 1
    # ms join: inside their 3 ms of slack. Behind two queued prompts of 200 tokens
    # (20 ms each, 2 ms a token over 20), they would lose 3.5 ms: past it. Each
    # prompt judged alone used to pass, and prompts piled onto decoding workers.
    slack = {"e": on_track(8, slack_s=0.003, remaining=20)}
    idle_queue = worker("e", "both", running=8)
    assert decide(request(100), state(idle_queue, slack=slack)) == Colocate("e")
    queued = worker("e", "both", running=8, waiting_tokens=400, waiting=2)
    decision = decide(request(100), state(queued, slack=slack))
    assert isinstance(decision, Reject) and decision.kind == "harm"


def test_requests_waiting_for_their_first_token_do_not_hide_the_batch_already_there():
    # a reports 8 decodes and b 9, none of them this router's (best effort). On b,
    # this router also placed 8 requests still waiting for their first token: they
    # will join those 9, not be 8 of them. Taken for the batch, they hid it: b's
    # unknown decodes counted as 1, its harm priced lower than a's 8, and b won.
    a, b = worker("a", "both", running=8), worker("b", "both", running=9)
    base = state(a, b, slack={"b": on_track(8, slack_s=0.5, remaining=20)})
    waiting = replace(base.budgets["b"], waiting=np.ones(8, dtype=bool))
    decision = decide(request(100), replace(base, budgets={"b": waiting}))
    assert decision == Colocate("a")


def test_prompts_still_to_come_stretch_the_steps_a_running_decode_expects():
    # e's step is 18 ms; having spent half its recent time on prompts, its decodes
    # expect 36 ms a token from now on. With 19 ms of slack over the 18 ms step
    # (37 ms a token allowed), the 1.5 ms this prompt takes from them breaks them
    # there, not where no prompts come.
    slack = {"e": on_track(8, slack_s=0.019, remaining=20)}
    calm = worker("e", "both", running=8)
    assert decide(request(100), state(calm, slack=slack)) == Colocate("e")
    busy = worker("e", "both", running=8, prompt_share=0.5)
    decision = decide(request(100), state(busy, slack=slack))
    assert isinstance(decision, Reject) and decision.kind == "harm"


def test_a_more_important_request_may_take_less_important_headroom():
    e = worker("e", "both", running=8)
    slack = {"e": on_track(8, slack_s=0.0005, remaining=40, priority=5)}
    assert decide(request(100, priority=0), state(e, slack=slack)) == Colocate("e")
    assert isinstance(decide(request(100, priority=5), state(e, slack=slack)), Reject)


def test_requests_already_past_their_slo_do_not_block_admission():
    e = worker("e", "both", running=2)
    assert decide(request(100), state(e, slack={"e": on_track(2, slack_s=-0.01)})) \
        == Colocate("e")


def test_a_ttft_forecast_at_the_slos_edge_is_refused_within_the_headroom():
    # 4,000 queued tokens + 100 on e: 440 ms, within a 480 ms SLO but not within the
    # 432 ms its 0.9 headroom leaves: placed only where the headroom is the SLO
    e = worker("e", "both", waiting_tokens=4000, waiting=2)
    edge = request(100, slo=Slo(ttft_s=0.48))
    refused = decide(edge, state(e))
    assert isinstance(refused, Reject) and refused.kind == "ttft"
    assert "headroom" in refused.reason and refused.ttft_s == pytest.approx(0.44)
    assert decide(edge, state(e, headroom=1.0)) == Colocate("e")
    with pytest.raises(ValueError, match="ttft_headroom"):
        RoutingSpec(ttft_headroom=0.0)


def test_a_prompt_waits_for_a_sequence_slot_where_max_num_seqs_requests_run():
    # e runs its max_num_seqs (8): its scheduler admits no prompt until one ends. The
    # first of its requests to end has 30 tokens left, at e's step (10 + 8 x 1 ms):
    # 540 ms, then the prompt alone (10 ms step + 10 ms): 560 ms, not e's 28 ms.
    full = worker("e", "both", running=8, max_num_seqs=8)
    running = {"e": [(0, 0.05, 30)] + [(0, 0.05, 200)] * 7}
    long_slo = request(100, slo=Slo(ttft_s=1.0, tpot_s=0.05))
    decision = decide(long_slo, state(full, slack=running))
    assert decision == Colocate("e") and decision.ttft_s == pytest.approx(0.560)
    # f has a prompt queue (230 ms) but free slots: it is the one within a 500 ms SLO
    queued = worker("f", "both", waiting_tokens=2000, waiting=1, max_num_seqs=8)
    assert decide(request(100), state(full, queued, slack=running)) == Colocate("f")
    # a slot e frees only when a request this router does not know of ends: unknown,
    # refused on its TTFT, to retry after the configured interval
    alone = decide(request(100), state(full, slack={"e": running["e"][:0]}))
    assert isinstance(alone, Reject) and alone.kind == "ttft" and alone.retry_after_s == 1.0


def test_an_impossible_ttft_is_rejected_with_the_predicted_wait():
    # 4,000 queued tokens + 100: 3 steps (30 ms) + 410 ms = 440 ms against the 90 ms
    # a 100 ms SLO leaves at the default 0.9 headroom: it would fit 350 ms from now
    e = worker("e", "both", waiting_tokens=4000, waiting=2)
    decision = decide(request(100, slo=Slo(ttft_s=0.1)), state(e))
    assert isinstance(decision, Reject) and decision.kind == "ttft"
    assert decision.retry_after_s == pytest.approx(0.35)


def test_a_ttft_slo_no_idle_worker_could_meet_is_unattainable_not_a_wait():
    # Idle, 100 tokens: 1 step (10 ms) + 10 ms = 20 ms. An SLO of 15 ms cannot be met
    # by any placement however long the client retries; one of 25 ms can, once the
    # 4,100-token queue ahead drains (the transient refusal above, with its wait).
    idle, queued = worker("a", "both"), worker("e", "both", waiting_tokens=4000, waiting=2)
    never = decide(request(100, slo=Slo(ttft_s=0.015)), state(idle, queued))
    assert isinstance(never, Reject) and never.kind == "unattainable"
    assert never.ttft_s == pytest.approx(20 * MS)
    assert "slo_ttft_ms 15 cannot be met" in never.reason and "20 ms" in never.reason
    later = decide(request(100, slo=Slo(ttft_s=0.025)), state(queued))
    assert isinstance(later, Reject) and later.kind == "ttft" and later.retry_after_s > 0
    # Admission "always" takes the least bad, as for any miss.
    assert decide(request(100, slo=Slo(ttft_s=0.015)),
                  state(idle, queued, admission="always")) == Colocate("a")


def test_an_impossible_tpot_is_rejected():
    e = worker("e", "both", running=60)  # a step of 71 ms with it
    decision = decide(request(10, slo=Slo(tpot_s=0.02)), state(e))
    assert isinstance(decision, Reject) and decision.kind == "tpot"


def test_a_stale_report_is_unknown_and_the_routers_own_counts_stand_in():
    # d0's report (8 running, no free blocks) is 10 s old: neither full nor loaded;
    # this router has 1 request on it, and 3 on d1.
    s = state(worker("p", "prefill"),
              worker("d0", "decode", running=8, free=0, heard_s_ago=10.0, inflight=1),
              worker("d1", "decode", running=3, inflight=3),
              transfer={("p", "d0"): FAST, ("p", "d1"): FAST})
    decision = decide(request(100), s)
    assert decision == Disaggregate("p", "d0")
    assert decision.tpot_s == pytest.approx(12 * MS)  # 2 decodes: 10 + 2 ms


def test_a_worker_reporting_no_room_for_the_kv_is_used_only_when_nothing_else_is():
    s = state(worker("p", "prefill"), worker("d0", "decode", free=2),
              worker("d1", "decode", running=20), transfer={})
    assert decide(request(100), s) == Disaggregate("p", "d1")
    assert isinstance(decide(request(100), state(worker("p", "prefill"),
                                                  worker("d0", "decode", free=2))), Reject)


def test_draining_and_refusing_workers_are_not_candidates():
    from dataclasses import replace
    s = state(worker("a", "both"), replace(worker("b", "both"), draining=True))
    assert decide(request(32), s) == Colocate("a")
    refused = RequestView(32, 3, refused=frozenset({"a"}))
    assert isinstance(decide(refused, s), Reject)


def test_colocated_mode_never_splits_and_disaggregated_mode_always_does():
    both = state(worker("a", "both"), worker("b", "both", running=50))
    assert all(isinstance(decide(request(n), both), Colocate) for n in (10, 1000))
    split = state(worker("p", "prefill"), worker("d", "decode"))
    assert all(isinstance(decide(request(n), split), Disaggregate) for n in (10, 1000))


def test_a_tpot_forecast_refuses_only_beside_a_running_batch_and_never_one_token():
    # A step of 71 ms misses a 20 ms TPOT SLO; an idle worker's forecast (11 ms with
    # this cost) would not, but a slow one alone is admitted: only a measurement can
    # correct a model that overestimates, and nothing would serve it faster.
    slow = StepCost(base_s=0.05, prefill_token_s=1e-4, prefill_pair_s=0.0,
                    decode_seq_s=0.001, decode_context_s=0.0)
    assert decide(request(10, slo=Slo(tpot_s=0.02)),
                  state(worker("e", "both", cost=slow))) == Colocate("e")
    busy = state(worker("e", "both", running=1, cost=slow))
    refused = decide(request(10, slo=Slo(tpot_s=0.02)), busy)
    assert refused.kind == "tpot" and refused.retry_after_s == 1.0  # no request's end known
    # This router's two requests there, 10 and 30 tokens from their ends: the batch
    # is only fast enough once both end (alone, it would be admitted), in 30 steps
    # of 52 ms.
    known = state(worker("e", "both", running=2, cost=slow),
                  slack={"e": [(0, 0.1, 10), (0, 0.1, 30)]})
    assert decide(request(10, slo=Slo(tpot_s=0.02)), known).retry_after_s == \
        pytest.approx(30 * 0.052)
    # 10 ms per sequence: joining 3 makes a 50 ms step, 15 ms over a 35 ms SLO, so
    # 2 must end: the second soonest, in 20 steps of 40 ms.
    per_seq = StepCost(base_s=0.01, prefill_token_s=1e-4, prefill_pair_s=0.0,
                       decode_seq_s=0.01, decode_context_s=0.0)
    three = state(worker("e", "both", running=3, cost=per_seq),
                  slack={"e": [(0, 0.1, n) for n in (30, 10, 20)]})
    assert decide(request(10, slo=Slo(tpot_s=0.035)), three).retry_after_s == \
        pytest.approx(20 * 0.040)
    assert decide(request(10, slo=Slo(tpot_s=0.02), max_tokens=1), busy) == Colocate("e")
    # Its TPOT measured twice the model's forecasts: 100 ms forecast, 30% over a 70
    # ms SLO. The step (50 ms with it) must shrink by 30% too: 2 must end, as above
    # (not 30 ms of calibrated time at 10 ms per sequence: 3).
    slow = replace(three.workers[0], calibration=Calibration({("tpot", "colocate"): 2.0}))
    assert decide(request(10, slo=Slo(tpot_s=0.070)),
                  replace(three, workers=(slow,))).retry_after_s == \
        pytest.approx(20 * 0.040)


def test_past_the_shortlist_the_best_workers_are_still_found():
    # 40 prefill and 40 decode workers: only a shortlist of each is forecast. The one
    # prefill worker holding the prompt's prefix (behind a queue of 200 tokens, against
    # 100 to 139 on the others) and the one idle decode worker, both listed last, are
    # the ones a rough estimate puts on the shortlist, and the forecast chooses.
    prefill = [worker(f"p{i}", "prefill", waiting_tokens=100 + i, waiting=1) for i in range(40)]
    decode = [worker(f"d{i}", "decode", running=5 + i % 3) for i in range(40)]
    hit = worker("p-hit", "prefill", waiting_tokens=200, waiting=1)
    s = state(*prefill, hit, *decode, worker("d-idle", "decode"))
    decision = decide(request(1024, cached={"p-hit": 960}), s)
    assert decision == Disaggregate("p-hit", "d-idle")
    # 200 + 64 tokens in one step (10 + 26.4 ms), then 64 blocks at the default
    # link (2 ms + 1 ns per byte)
    assert decision.ttft_s == pytest.approx((10 + 26.4 + 2 + 0.064) * MS)


def test_the_decode_side_avoids_a_worker_whose_steps_prompts_keep_stretching():
    # a and b each decode 4 requests; a spent half its recent time computing prompts,
    # so a decode there is forecast at (10 + 5 x 1 ms) / (1 - 0.5) = 30 ms a token,
    # past the 20 ms SLO, and on b at 15 ms. Blind to the share, a (first by name)
    # would decode it at a forecast 15 ms.
    slo = Slo(ttft_s=0.5, tpot_s=0.020)
    a, b = worker("a", "both", running=4, prompt_share=0.5), worker("b", "both", running=4)
    decision = decide(request(100, slo=slo), state(a, b, adaptive=True))
    assert decision == Colocate("b")
    assert decision.tpot_s == pytest.approx(15 * MS)
    blind = decide(request(100, slo=slo), state(worker("a", "both", running=4), b,
                                                adaptive=True))
    assert blind == Colocate("a") and blind.tpot_s == pytest.approx(15 * MS)


def test_the_time_a_request_already_waited_counts_in_its_ttft():
    # 100 tokens on idle e: 1 step (10 ms) + 10 ms, after 420 ms waiting for capacity
    # (a 500 ms TTFT SLO, of which the 0.9 headroom leaves 450 ms): 440 ms from its
    # arrival, which is what it is measured by.
    s = state(worker("e", "both"))
    waited = RequestView(100, 7, slo=Slo(ttft_s=0.5, tpot_s=0.05), max_tokens=101,
                         waited_s=0.42)
    decision = decide(waited, s)
    assert decision == Colocate("e") and decision.ttft_s == pytest.approx(0.440)
    # 20 ms more and it would not make it: refused, its Retry-After from a fresh start
    late = decide(replace(waited, waited_s=0.44), s)
    assert isinstance(late, Reject) and late.kind == "ttft"
    assert late.ttft_s == pytest.approx(0.460)
    assert late.retry_after_s == 0.05  # the least: afresh, it would fit at once


def test_forecasts_are_scaled_by_what_each_worker_measured_before():
    # a and b alike, idle; a's colocated requests measured twice their forecast TPOT,
    # so a request there is forecast at 2 x 11 ms: past the 20 ms SLO. On b, 11 ms.
    slo = Slo(ttft_s=0.5, tpot_s=0.020)
    slow = Calibration({("tpot", "colocate"): 2.0, ("ttft", "colocate"): 1.5})
    a = replace(worker("a", "both"), calibration=slow)
    decision = decide(request(32, slo=slo), state(a, worker("b", "both")))
    assert decision == Colocate("b") and decision.tpot_s == pytest.approx(11 * MS)
    # a alone: refused on its TPOT? no: nothing runs there, so only measuring can tell
    alone = decide(request(32, slo=slo), state(a))
    assert alone == Colocate("a")
    assert alone.ttft_s == pytest.approx(1.5 * 13.2 * MS)
    assert alone.tpot_s == pytest.approx(2 * 11 * MS)
    # the decision carries the factors, so what the model forecast itself is known
    assert (alone.ttft_scale, alone.tpot_scale) == (1.5, 2.0)
