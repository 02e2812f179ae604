"""The SLO planner on hand-set observations, without Ray, torch or a clock.

Every worker has the same step cost:
    step = 10 ms + 0.1 ms per prefill token + 1 ms per decode sequence
so with a 100-token prompt and 100 output tokens at SLOs TTFT 500 ms / TPOT 50 ms:
    TTFT behind Q queued tokens ~ 10 ms per 2,048-token step + 0.1 ms x (Q + 100)
    TPOT beside S running decodes = 10 ms + (S + 1) ms
    demand: prefill 20 ms of a worker per request, kept at most 95% busy -> rate x
            0.02 / 0.95 workers; decode 40 sequences per worker at steps of the 50 ms
            SLO -> rate x 100 x 0.05 / 40 (at 0.8 x SLO, to shrink: 30 at 40 ms)"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pdserve.engine.latency_model import StepCost
from pdserve.router.planner.core import (
    Observation,
    PlannerConfig,
    PlannerState,
    Traffic,
    WorkerView,
    plan,
)
from pdserve.router.policy.latency_forecast import WorkerLoad
from pdserve.router.slo import Slo

COST = StepCost(base_s=0.010, prefill_token_s=1e-4, prefill_pair_s=0.0, decode_seq_s=0.001,
                decode_context_s=0.0)
SLO = Slo(ttft_s=0.5, tpot_s=0.05)
QUIET = Traffic(rate=0.5, isl=100, osl=100)


def view(wid, role, state="serving", age=100.0, queued_tokens=0, seqs=0, kv=0.0):
    return WorkerView(wid, role, state, age, COST,
                      WorkerLoad(queued_tokens=queued_tokens, queued_requests=queued_tokens // 100,
                                 decode_seqs=seqs, decode_context=seqs * 150),
                      kv_used=kv)


def config(**changes) -> PlannerConfig:
    return replace(PlannerConfig(max_workers=8, sustain=3, down_sustain=4,
                                 reversal_guard_s=0.0, cold_start_s=10.0), **changes)


def ticks(workers, traffic=QUIET, n=1, cfg=None, state=PlannerState(), start=0.0):
    """n ticks on the same observation; every plan's actions, and the last state."""
    cfg = cfg or config()
    seen = []
    for i in range(n):
        out = plan(Observation(start + 5.0 * i, tuple(workers), traffic, SLO), state, cfg)
        state = out.state
        seen.append(out.actions)
    return seen, state, out


def test_a_transient_miss_does_nothing_and_a_sustained_one_adds():
    busy = [view("p0", "prefill", queued_tokens=8000), view("d0", "decode")]  # TTFT ~ 850 ms
    calm = [view("p0", "prefill"), view("d0", "decode")]
    seen, state, _ = ticks(busy, n=2)
    assert seen == [(), ()]
    seen, state, _ = ticks(calm, state=state)  # the signal breaks: the count starts over
    seen, state, _ = ticks(busy, n=2, state=state)
    assert seen == [(), ()]
    seen, _, out = ticks(busy, state=state)
    add, = seen[0]
    assert (add.kind, add.role) == ("add", "prefill")
    assert "every prefill worker misses" in add.reason and "TTFT forecast" in add.reason
    assert "for 3 ticks" in add.reason


def test_a_pool_shrinks_only_when_its_load_fits_one_worker_fewer():
    # 2 x 20 decodes: at 1 worker 40 -> TPOT 51 ms > 0.8 x 50. Never removed.
    loaded = [view("p0", "prefill"), view("d0", "decode", seqs=20), view("d1", "decode", seqs=20)]
    seen, _, out = ticks(loaded, traffic=Traffic(), n=20)
    assert not any(seen) and out.signals["decode"].spare == ""
    # 2 x 5: at 1 worker 10 -> 21 ms. Removed after 4 ticks, the less loaded one.
    light = [view("p0", "prefill"), view("d0", "decode", seqs=5), view("d1", "decode", seqs=4)]
    seen, _, _ = ticks(light, traffic=Traffic(), n=4)
    assert seen[:3] == [(), (), ()]
    remove, = seen[3]
    assert (remove.kind, remove.role, remove.worker_id) == ("remove", "decode", "d1")
    assert "at 1 serving worker(s) it forecasts TPOT 20.0 ms" in remove.reason


def test_a_new_workers_cold_start_samples_are_not_read_and_it_holds_more_adds():
    # d1 joined 2 s ago and reports a huge batch (its warm-up): not short.
    cold = [view("p0", "prefill"), view("d0", "decode", seqs=5),
            view("d1", "decode", age=2.0, seqs=60)]
    seen, _, out = ticks(cold, n=10)
    assert not any(seen) and out.signals["decode"].short == ""
    # The warm one misses, but d1 is capacity on its way: nothing more is added.
    missing = [view("p0", "prefill"), view("d0", "decode", seqs=60),
               view("d1", "decode", state="starting", age=20.0)]
    seen, _, out = ticks(missing, n=10)
    assert not any(seen) and out.signals["decode"].short and out.signals["decode"].coming == 1


def _apply(workers: list[WorkerView], actions, now: float) -> list[WorkerView]:
    out = [w for w in workers if w.worker_id not in {a.worker_id for a in actions
                                                     if a.kind == "remove"}]
    for i, a in enumerate(actions):
        if a.kind == "add":
            out.append(view(f"{a.role}-new{now:g}-{i}", a.role, state="starting", age=0.0))
        elif a.kind == "flip":
            out = [replace(w, role=a.role, age_s=0.0) if w.worker_id == a.worker_id else w
                   for w in out]
    return out


def test_with_no_traffic_every_pool_returns_to_its_minimum_one_worker_at_a_time():
    workers = [view(f"p{i}", "prefill") for i in range(3)] + \
              [view(f"d{i}", "decode") for i in range(3)]
    state, removals = PlannerState(), []
    for i in range(60):
        out = plan(Observation(5.0 * i, tuple(workers), Traffic(), SLO), state, config())
        state = out.state
        assert all(a.kind == "remove" for a in out.actions)
        assert len({a.role for a in out.actions}) == len(out.actions)  # one per pool a tick
        removals += [(i, a.role) for a in out.actions]
        workers = _apply(workers, out.actions, 5.0 * i)
    assert sorted(w.role for w in workers) == ["decode", "prefill"]
    assert [tick for tick, role in removals if role == "decode"] == [3, 7]  # 4 ticks apart


def test_a_full_budget_rebalances_by_flipping_an_idle_pools_worker():
    cfg = config(max_workers=4)
    workers = [view("p0", "prefill"), view("p1", "prefill", queued_tokens=100),
               view("d0", "decode", seqs=60), view("d1", "decode", seqs=60)]
    seen, _, out = ticks(workers, n=3, cfg=cfg)
    flip, = seen[2]
    assert (flip.kind, flip.role, flip.worker_id) == ("flip", "decode", "p0")
    assert out.desired == {"prefill": 1, "decode": 3}
    assert "every decode worker misses" in flip.reason and "the prefill pool can spare" \
        in flip.reason
    # Room in the budget, but a pool that can spare one still gives it: no weights load.
    seen, _, _ = ticks(workers, n=3, cfg=config(max_workers=8))
    assert seen[2][0].kind == "flip"
    # Nothing to spare and no budget: it holds.
    busy = [replace(w, load=WorkerLoad(queued_tokens=6000, queued_requests=60))
            if w.role == "prefill" else w for w in workers]
    seen, _, out = ticks(busy, n=5, cfg=cfg)
    assert not any(seen) and out.signals["decode"].short


def test_workers_of_several_devices_count_them_and_flip_only_between_equal_pools():
    """A decode pool of tensor-parallel workers (4 devices each) beside prefill workers of
    1: the device budget bounds what is added, and no prefill worker flips to decode
    (its one rank could not hold a decode worker's four)."""
    workers = [view("p0", "prefill"), view("p1", "prefill", queued_tokens=100),
               view("d0", "decode", seqs=60), view("d1", "decode", seqs=60)]
    tp = dict(devices_per_worker=(("decode", 4), ("prefill", 1)))
    seen, _, out = ticks(workers, n=3, cfg=config(max_workers=8, max_devices=14, **tp))
    assert [(a.kind, a.role) for a in seen[2]] == [("add", "decode")]  # 2 + 3 x 4 = 14
    assert out.desired == {"prefill": 2, "decode": 3}
    seen, _, _ = ticks(workers, n=3, cfg=config(max_workers=8, max_devices=13, **tp))
    assert not any(seen)  # a fourth decode worker's 4 devices do not fit 13
    with pytest.raises(ValueError, match="max_devices"):
        config(max_devices=1, **tp)


def test_a_rising_rate_adds_ahead_of_the_miss():
    # Now 50 req/s, rising 1 req/s each second: 90 by the time a worker asked for once
    # the signal held (2 more ticks of 5 s) serves, 30 s later -> prefill 90 x 20 ms /
    # 0.95 = 1.9, so 2 workers, although the one there misses nothing yet.
    rising = Traffic(rate=50.0, rate_slope=1.0, isl=100, osl=1)
    workers = [view("p0", "prefill"), view("d0", "decode")]
    seen, _, out = ticks(workers, traffic=rising, n=3, cfg=config(roles=("prefill",)))
    assert out.signals["prefill"].demand == 2
    add, = seen[2]
    assert add.role == "prefill" and "the demand needs 2 workers, it has 1" in add.reason


def test_at_a_repeating_load_s_trough_the_pool_grows_for_the_rise_it_took_last_period():
    # Now 20 req/s, flat. One period ago (12 bins of 5 s, the 2 before it as the rate
    # then: 20) it rose from 20 to 90. A worker asked for once the signal held serves
    # 30 s + 2 ticks = 40 s from now: 8 bins into that course, 70-80-90 around it ->
    # 80 req/s -> prefill 80 x 20 ms / 0.95 = 1.7, so 2 workers. On the flat trend: 1.
    course = (20.0, 20.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 20.0, 20.0)
    trough = Traffic(rate=20.0, isl=100, osl=1, echo=(20.0, 20.0) + course, echo_bin_s=5.0,
                     echo_lead=2)
    workers = [view("p0", "prefill"), view("d0", "decode")]
    cfg = config(roles=("prefill",), startup_s=30.0)
    seen, _, out = ticks(workers, traffic=trough, n=3, cfg=cfg)
    assert out.signals["prefill"].demand == 2
    add, = seen[2]
    assert "the demand needs 2 workers, it has 1 (80.0 req/s a start-up ahead, now 20.0" \
        in add.reason
    _, _, flat = ticks(workers, traffic=replace(trough, echo=()), n=3, cfg=cfg)
    assert flat.signals["prefill"].demand == 1


def test_a_steady_load_settles_without_oscillating():
    """A fluid model: 45 decodes in all, spread over the decode workers that serve;
    a new worker serves 30 s after it is asked for. At 1 worker TPOT is 56 ms (a
    miss); at 2, 34 ms, and 1 fewer again would forecast 56 > 40: it stays at 2."""
    cfg = config(roles=("decode",), min_workers=(("decode", 1),), startup_s=30.0)
    workers, state, actions = [view("d0", "decode")], PlannerState(), []
    for i in range(400):
        now = 5.0 * i
        serving = [w for w in workers if w.state == "serving"]
        workers = [replace(w, state="serving" if w.state == "serving" or w.age_s >= 30 else
                           "starting", age_s=w.age_s + 5.0,
                           load=WorkerLoad(decode_seqs=45 // len(serving),
                                           decode_context=45 // len(serving) * 150))
                   for w in workers]
        out = plan(Observation(now, tuple(workers), Traffic(rate=0.0, isl=100, osl=100), SLO),
                   state, cfg)
        state = out.state
        actions += out.actions
        workers = _apply(workers, out.actions, now)
    assert [(a.kind, a.role) for a in actions] == [("add", "decode")], actions
    assert len(workers) == 2


def test_a_worker_that_never_finishes_starting_does_not_block_scale_down():
    workers = [view("d0", "decode"), view("d1", "decode"),
               view("d2", "decode", state="starting", age=1000.0), view("p0", "prefill")]
    seen, _, _ = ticks(workers, traffic=Traffic(), n=4)
    remove, = seen[3]
    assert (remove.kind, remove.worker_id) == ("remove", "d2")  # the stuck one first


@pytest.mark.parametrize("seed", range(5))
def test_bounds_hold_at_every_tick_whatever_it_observes(seed):
    rng = random.Random(seed)
    cfg = config(max_workers=6, min_workers=(("prefill", 1), ("decode", 2)),
                 max_workers_per_pool=(("prefill", 3), ("decode", 4)), sustain=1,
                 down_sustain=1)
    workers = [view("p0", "prefill"), view("d0", "decode"), view("d1", "decode")]
    state = PlannerState()
    for i in range(300):
        workers = [replace(w, state=rng.choice(["serving", "serving", "starting", "stalled"]),
                           age_s=rng.choice([1.0, 100.0]),
                           load=WorkerLoad(queued_tokens=rng.choice([0, 100, 20000]),
                                           decode_seqs=rng.choice([0, 5, 80])),
                           kv_used=rng.random()) for w in workers]
        traffic = Traffic(rate=rng.choice([0.0, 5.0, 500.0]), rate_slope=rng.uniform(-2, 2),
                          isl=rng.choice([0, 100, 3000]), osl=rng.choice([0, 100]))
        out = plan(Observation(5.0 * i, tuple(workers), traffic, SLO), state, cfg)
        state = out.state
        workers = _apply(workers, out.actions, 5.0 * i)
        counts = {r: sum(w.role == r for w in workers) for r in ("prefill", "decode")}
        assert 1 <= counts["prefill"] <= 3 and 2 <= counts["decode"] <= 4, (i, counts)
        assert len(workers) <= 6
        named = [a.worker_id for a in out.actions if a.worker_id]
        assert len(named) == len(set(named))  # no worker acted on twice


def test_a_config_that_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="minima exceed max_workers"):
        PlannerConfig(max_workers=1)
    with pytest.raises(ValueError, match="min <= max"):
        PlannerConfig(min_workers=(("prefill", 3),), max_workers_per_pool=(("prefill", 2),))
    with pytest.raises(ValueError, match="roles"):
        PlannerConfig(roles=("janitor",))


def test_the_planner_flags_reach_its_config_and_bad_ones_name_the_flag():
    from pdserve.router.config import AutoscaleSpec

    spec = AutoscaleSpec(autoscale=True, planner_down_ticks=3, planner_reversal_guard_s=15,
                         planner_load_factor=1.25)
    cfg = spec.planner_config(("prefill", "decode"))
    assert (cfg.down_sustain, cfg.reversal_guard_s, cfg.load_factor) == (3, 15, 1.25)
    with pytest.raises(ValueError, match="--planner-down-ticks"):
        AutoscaleSpec(planner_down_ticks=0)
    with pytest.raises(ValueError, match="--planner-reversal-guard-s"):
        AutoscaleSpec(planner_reversal_guard_s=-1)
    with pytest.raises(ValueError, match="--planner-load-factor"):
        AutoscaleSpec(planner_load_factor=0)
    with pytest.raises(ValueError, match="load_factor"):
        PlannerConfig(load_factor=-1.0)


def test_a_colocated_pool_grows_on_either_miss():
    cfg = config(roles=("both",))
    on_ttft = [view("e0", "both", queued_tokens=8000)]
    on_tpot = [view("e0", "both", seqs=60)]
    for workers, why in ((on_ttft, "TTFT forecast"), (on_tpot, "TPOT forecast")):
        seen, _, _ = ticks(workers, n=3, cfg=cfg)
        add, = seen[2]
        assert (add.kind, add.role) == ("add", "both") and why in add.reason


def test_a_colocated_pool_is_sized_with_one_step_overhead_and_holds_inside_its_band():
    """Colocated at 100 + 100 tokens: a request is 10 ms of prompt and 100 decode
    steps of 1 ms each; at steps of the 50 ms SLO 40 ms of each are theirs, so r req/s
    need r x 0.11 / 0.8 workers (at 0.8 x SLO, 40 ms steps: r x 0.11 / 0.75). At 14
    req/s: 1.93 at the SLO, 2.05 at the margin."""
    cfg = config(roles=("both",), min_workers=(("both", 1),))
    steady = Traffic(rate=14.0, isl=100, osl=100)
    two = [view("e0", "both"), view("e1", "both")]
    seen, _, out = ticks(two, traffic=steady, n=20, cfg=cfg)
    # Summing a prefill pool's and a decode pool's demand counted the step overhead
    # twice: 0.29 + 1.87 workers, so 3.
    assert not any(seen) and (out.signals["both"].demand, out.signals["both"].keep) == (2, 3)
    three = two + [view("e2", "both")]
    seen, _, out = ticks(three, traffic=steady, n=20, cfg=cfg)
    assert not any(seen) and out.signals["both"].spare == ""  # 2 would be past the margin
    seen, _, out = ticks(three, traffic=replace(steady, rate=13.0), n=4, cfg=cfg)
    remove, = seen[3]
    assert (remove.kind, remove.role) == ("remove", "both")
    seen, _, out = ticks(two, traffic=replace(steady, rate=15.0), n=3, cfg=cfg)
    add, = seen[2]
    assert add.cause == "demand" and "the demand needs 3 workers, it has 2" in add.reason


def test_a_load_factor_counts_each_worker_for_more_and_sizes_the_pool_smaller():
    """The colocated pool above (a request: 0.11 s of a worker's steps, at 0.8 of each
    step): at 1.5 x a worker's load 14 req/s are sized as 9.3, 1.28 workers at the SLO
    and 1.37 at the margin, so three give one up where at 1 they hold; and 22 req/s
    need 3 workers, not 4."""
    steady = Traffic(rate=14.0, isl=100, osl=100)
    three = [view("e0", "both"), view("e1", "both"), view("e2", "both")]
    for factor, gives_up in ((1.0, False), (1.5, True)):
        cfg = config(roles=("both",), min_workers=(("both", 1),), load_factor=factor)
        seen, _, out = ticks(three, traffic=steady, n=4, cfg=cfg)
        assert out.signals["both"].keep == (2 if gives_up else 3)
        assert [(a.kind, a.cause) for a in seen[3]] == ([("remove", "spare")] if gives_up
                                                       else [])
    two = [view("e0", "both"), view("e1", "both")]
    for factor, needs in ((1.0, 4), (1.5, 3)):
        cfg = config(roles=("both",), min_workers=(("both", 1),), load_factor=factor)
        seen, _, out = ticks(two, traffic=replace(steady, rate=22.0), n=3, cfg=cfg)
        add = seen[2][0]
        assert f"the demand needs {needs} workers, it has 2" in add.reason
        assert ("at 1.5 x a worker's load" in add.reason) == (factor == 1.5)
        assert out.desired == {"both": needs}


def test_the_demand_gets_every_worker_it_lacks_at_once_even_while_one_is_coming():
    # 200 req/s looked ahead: 200 x 20 ms / 0.95 = 4.2 prefill workers; one serves and
    # one is starting, so 3 are added in one tick. A miss would add one, and wait.
    surge = Traffic(rate=200.0, isl=100, osl=1)
    workers = [view("p0", "prefill"), view("p1", "prefill", state="starting", age=5.0)]
    seen, _, out = ticks(workers, traffic=surge, n=3, cfg=config(roles=("prefill",)))
    assert seen[:2] == [(), ()]
    assert [(a.kind, a.role, a.cause) for a in seen[2]] == [("add", "prefill", "demand")] * 3
    assert "the demand needs 5 workers, it has 2 (200.0 req/s" in seen[2][0].reason
    assert out.desired == {"prefill": 5}


def test_a_falling_load_is_not_shrunk_for_ahead_of_time():
    # 14 req/s now, falling 0.3 req/s each second: 2 req/s 40 s ahead (the signal held
    # 2 more ticks of 5 s, then a 30 s start-up). The growth would look that far;
    # shrinking waits for the load itself to fall.
    cfg = config(roles=("both",), min_workers=(("both", 1),), startup_s=30.0)
    falling = Traffic(rate=14.0, rate_slope=-0.3, isl=100, osl=100)
    three = [view("e0", "both"), view("e1", "both"), view("e2", "both")]
    seen, _, out = ticks(three, traffic=falling, n=20, cfg=cfg)
    assert not any(seen) and out.signals["both"].keep == 3 and out.signals["both"].demand == 1


def test_decodes_that_cost_their_step_nothing_need_no_more_decode_workers():
    free = replace(COST, decode_seq_s=0.0, decode_context_s=0.0)
    workers = [replace(view("d0", "decode"), cost=free)]
    seen, _, out = ticks(workers, traffic=Traffic(rate=500.0, isl=100, osl=100), n=4,
                         cfg=config(roles=("decode",), min_workers=(("decode", 1),)))
    assert not any(seen) and out.signals["decode"].demand == 0


def test_a_decode_pool_grows_for_the_kv_a_rising_load_will_hold():
    # 2 req/s now, 4 req/s 40 s ahead (the signal held 2 more ticks of 5 s, then a 30 s
    # start-up). The worker runs 3 decodes at 13 ms steps holding 25% of its KV each.
    # Its TPOT needs half a worker at 4 req/s (4 x 100 x 50 ms / 40); its KV: 4 req/s
    # x 100 steps x 13 ms = 5.2 decoding at once, x 25% = 1.3 workers at 95% full each,
    # so a second is added before the KV is full (at 95% the worker would miss).
    # A load factor counts a worker for more of the SLO's load, not for more KV: the
    # same worker is added at 2 x a worker's load.
    rising = Traffic(rate=2.0, rate_slope=0.05, isl=100, osl=100)
    for factor in (1.0, 2.0):
        cfg = config(roles=("decode",), min_workers=(("decode", 1),), startup_s=30.0,
                     load_factor=factor)
        seen, _, out = ticks([view("d0", "decode", seqs=3, kv=0.75)], traffic=rising, n=3,
                             cfg=cfg)
        assert out.signals["decode"].demand == 2
        assert out.signals["decode"].short_cause == "demand"
        add, = seen[2]
        assert (add.kind, add.role) == ("add", "decode")
    cfg = config(roles=("decode",), min_workers=(("decode", 1),), startup_s=30.0)
    # Steady at the rate now (2.6 decoding at once: 0.68 of a worker), nothing added.
    seen, _, out = ticks([view("d0", "decode", seqs=3, kv=0.75)],
                         traffic=replace(rising, rate_slope=0.0), n=6, cfg=cfg)
    assert not any(seen) and out.signals["decode"].demand == 1


def test_a_worker_asked_for_is_not_given_up_before_it_could_serve_and_show_its_worth():
    # 60 req/s needs 2 prefill workers (60 x 20 ms / 0.95): one is asked for at 10 s.
    # Then the forecast falls: the pool could spare one at once, the starting one; it
    # is kept until a start-up (30 s) and the guard (15 s) after it was asked for.
    cfg = config(roles=("prefill",), min_workers=(("prefill", 1),), startup_s=30.0,
                 reversal_guard_s=15.0)
    seen, state, _ = ticks([view("p0", "prefill")], traffic=Traffic(rate=60.0, isl=100, osl=1),
                           n=3, cfg=cfg)
    assert [(a.kind, a.role) for a in seen[2]] == [("add", "prefill")]
    coming = [view("p0", "prefill"), view("p1", "prefill", state="starting", age=5.0)]
    seen, _, out = ticks(coming, n=12, cfg=cfg, state=state, start=15.0)
    removed = [(15.0 + 5 * i, a.worker_id) for i, actions in enumerate(seen) for a in actions]
    assert removed == [(55.0, "p1")], removed


def test_a_pool_whose_requests_miss_their_slos_is_not_shrunk():
    """The light decode pool of the shrink test above, whose forecasts would give a
    worker up, while 10 of its last 30 requests missed their SLOs (the forecasts are
    sized at the SLO's mean): it holds. Once they meet the target, or too few ended
    to read, it shrinks as before."""
    light = [view("p0", "prefill"), view("d0", "decode", seqs=5), view("d1", "decode", seqs=4)]
    missing = Traffic(rate=0.5, isl=100, osl=100, judged=(("decode", 20, 30),
                                                          ("prefill", 30, 30)))
    seen, _, out = ticks(light, traffic=missing, n=10)
    assert not any(seen) and out.signals["decode"].spare == ""
    assert out.signals["decode"].keep < 2  # the forecasts alone would give one up
    assert (out.signals["decode"].met, out.signals["decode"].judged) == (20, 30)
    for judged in ((("decode", 27, 30),), (("decode", 5, 19),)):
        seen, _, _ = ticks(light, traffic=replace(missing, judged=judged), n=4)
        remove, = seen[3]
        assert (remove.kind, remove.role, remove.cause) == ("remove", "decode", "spare")
