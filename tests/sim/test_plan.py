"""`pdserve sim plan`: every shape of a budget is searched, and each search ends on a
rate that holds the SLOs with the next rate probed above it failing; a probe stopped
once its verdict is certain gives the verdict the whole run gives; shapes start from
their neighbour's rate, and the table does not depend on how many run at once; the
command shows each probe, writes each shape as it ends, and keeps what a stopped run
found."""
from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import pickle
import subprocess
import sys

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import make_workload
from pdserve.cli import main
from pdserve.router.config import PoolSpec
from pdserve.sim.driver import Load
from pdserve.sim.plan import (
    Draws,
    Search,
    Shape,
    max_rate,
    min_duration_s,
    neighbours,
    plan,
    probe,
    shapes,
)
from pdserve.sim.run import Setup, simulate
from tests.sim.sims import small_profile

SLO_ = SLO(ttft_ms=300, tpot_ms=30)


def test_a_budget_s_shapes_are_every_split_colocated_and_adaptive():
    found = [(s.pools.mode, s.pools.prefill_workers, s.pools.decode_workers, s.devices)
             for s in shapes(4)]
    assert found == [("disaggregated", 1, 3, 4), ("disaggregated", 2, 2, 4),
                     ("disaggregated", 3, 1, 4), ("colocated", 0, 4, 4), ("adaptive", 0, 4, 4)]


def test_each_pool_s_tensor_parallel_size_is_searched_within_the_device_budget():
    """DistServe's search: the parallelism of each phase chosen apart. 16 devices in
    workers of 4 or 8: every split that leaves less than a decode worker unused."""
    found = {s.name: s.devices for s in shapes(16, (4, 8))}
    assert found == {
        "1P:3D TP 4:4": 16, "2P:2D TP 4:4": 16, "3P:1D TP 4:4": 16,
        "1P:1D TP 4:8": 12, "2P:1D TP 4:8": 16, "1P:2D TP 8:4": 16, "1P:1D TP 8:8": 16,
        "colocated x4 TP 4": 16, "adaptive x4 TP 4": 16, "colocated x2 TP 8": 16,
        "adaptive x2 TP 8": 16}
    with pytest.raises(ValueError, match="at least 16 devices"):
        shapes(12, (8,))
    all_ = shapes(16, (4, 8))
    after = dict(zip((s.name for s in all_), (None if a is None else all_[a].name
                                              for a in neighbours(all_))))
    assert after == {
        "1P:3D TP 4:4": "2P:2D TP 4:4", "2P:2D TP 4:4": None, "3P:1D TP 4:4": "2P:2D TP 4:4",
        "1P:1D TP 4:8": "2P:1D TP 4:8", "2P:1D TP 4:8": None, "1P:2D TP 8:4": None,
        "1P:1D TP 8:8": None, "colocated x4 TP 4": None,
        "adaptive x4 TP 4": "colocated x4 TP 4", "colocated x2 TP 8": None,
        "adaptive x2 TP 8": "colocated x2 TP 8"}


def test_the_search_brackets_the_highest_rate_that_holds():
    profile = small_profile()
    slo = SLO(ttft_ms=300, tpot_ms=30)
    found = max_rate(Setup(profile=profile, pools=PoolSpec(0, 2, mode="colocated")),
                     lambda n: make_workload("azure-conv", n, profile.vocab_size, 1, 0.25),
                     Load(slo=slo), first_rate=4.0, iterations=3, min_requests=60,
                     min_duration_s=5.0)
    held = [p for p in found.probes if p.holds]
    failed = [p for p in found.probes if not p.holds]
    assert held and failed and found.max_rate == max(p.rate for p in held)
    assert found.max_rate < min(p.rate for p in failed if p.rate > found.max_rate)


def test_the_command_writes_the_table_best_first(tmp_path, capsys):
    small_profile().save(tmp_path / "profile.json")
    assert main(["sim", "plan", "--budget", "2", "--profile", str(tmp_path / "profile.json"),
                 "--workload", "azure-code", "--scale", "0.1", "--num-prompts", "40",
                 "--min-duration", "2", "--iterations", "2", "--first-rate", "8",
                 "--goodput", "ttft:300", "tpot:30", "--out-dir", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    rates = [s["goodput_per_worker"] for s in plan["shapes"]]
    assert [s["pools"] for s in plan["shapes"]][0] in capsys.readouterr().out
    assert rates == sorted(rates, reverse=True) and len(rates) == 3


def test_a_probe_stopped_when_certain_gives_the_whole_run_s_verdict():
    profile = small_profile()
    setup = Setup(profile=profile, pools=PoolSpec(0, 2, mode="colocated"))
    requests = make_workload("azure-conv", 80, profile.vocab_size, 1, 0.25)
    early = {True: 0, False: 0}
    for rate in (2.0, 8.0, 16.0, 32.0, 128.0):
        load = Load(request_rate=rate, slo=SLO_)
        whole = simulate(setup, requests, load)["slo_attainment"]
        p = probe(setup, requests, load)
        assert p.holds == (whole >= 0.9), (rate, whole)
        if p.ended < len(requests):
            assert p.attainment is None
            early[p.holds] += 1
        else:
            assert p.attainment == pytest.approx(whole)
    assert early[True] and early[False]  # both verdicts came before the run's end


def test_draws_are_the_first_n_of_one_sequence_drawn_once_and_only_as_sent():
    profile = small_profile()

    def draw():
        draw.calls += 1
        return iter(make_workload("azure-conv", 10_000, profile.vocab_size, 1, 0.25))
    draw.calls = 0
    draws = Draws(draw)
    whole = make_workload("azure-conv", 60, profile.vocab_size, 1, 0.25)
    assert list(draws(20)) == whole[:20] and len(draws(60)) == 60
    assert list(draws(60)) == whole and list(draws(30)) == whole[:30]
    assert draw.calls == 1 and len(draws._kept) == 60
    copy = pickle.loads(pickle.dumps(Draws(functools.partial(
        iter, make_workload("azure-conv", 100, profile.vocab_size, 1, 0.25)))))
    assert list(itertools.islice(copy(100), 5)) == whole[:5] and len(copy._kept) == 5
    # A probe at a rate far beyond the cluster's: its verdict comes early, and the
    # requests it never sent are never drawn.
    early = probe(Setup(profile=profile, pools=PoolSpec(0, 2, mode="colocated")),
                  copy(100), Load(request_rate=400.0, slo=SLO_))
    assert not early.holds and early.ended < 100 and len(copy._kept) < 100


def test_a_probe_lasts_long_enough_for_a_rate_one_bracket_too_high_to_fail():
    assert min_duration_s(SLO(ttft_ms=500), 5) == pytest.approx(0.5 * 32 / 0.9)
    assert min_duration_s(SLO(ttft_ms=500), 4) == pytest.approx(0.5 * 16 / 0.9)
    assert min_duration_s(SLO(ttft_ms=2000), 4) > min_duration_s(SLO(ttft_ms=500), 4)
    assert min_duration_s(SLO(tpot_ms=50), 5) == min_duration_s(SLO(ttft_ms=10), 1) == 5.0


def test_each_split_starts_from_the_split_two_nearer_the_even_one():
    named = dict(zip((f"{s.pools.prefill_workers}:{s.pools.mode}" for s in shapes(6)),
                     neighbours(shapes(6))))
    assert named == {"1:disaggregated": 2, "2:disaggregated": 2, "3:disaggregated": None,
                     "4:disaggregated": 2, "5:disaggregated": 2, "0:colocated": None,
                     "0:adaptive": 5}
    # 16 workers: two chains each side of 8 prefill workers, none longer than 4
    after = neighbours(shapes(16))

    def chain(i: int) -> int:
        return 0 if after[i] is None else 1 + chain(after[i])
    assert [i + 1 for i, a in enumerate(after[:15]) if a is None] == [8]
    assert max(map(chain, range(17))) == 4
    assert [after[i] + 1 for i in (8, 9, 10, 14)] == [8, 8, 9, 13]  # 9, 10, 11, 15


def small_search() -> Search:
    profile = small_profile()
    return Search(setup=Setup(profile=profile, pools=PoolSpec(1, 1)),
                  workload=functools.partial(make_workload, "azure-conv",
                                             vocab_size=profile.vocab_size, seed=1,
                                             scale=0.25),
                  load=Load(slo=SLO_), first_rate=4.0, iterations=3, min_requests=40,
                  min_duration_s=3.0)


def test_a_neighbour_s_start_needs_fewer_probes_and_finds_the_rate_within_precision():
    search = small_search()
    cold = search.run(Shape(PoolSpec(0, 2, mode="adaptive")), None)
    colocated = search.run(Shape(PoolSpec(0, 2, mode="colocated")), None)
    warm = search.run(Shape(PoolSpec(0, 2, mode="adaptive")), colocated.max_rate)
    assert warm.probes[0].rate == colocated.max_rate
    assert len(warm.probes) < len(cold.probes)
    assert warm.max_rate == pytest.approx(cold.max_rate, rel=2 * 2 ** -search.iterations)


def test_the_table_does_not_depend_on_the_jobs():
    def searched(jobs: int) -> dict:
        return {s.name: (s.max_rate, [(p.rate, p.holds) for p in s.probes])
                for s in plan(small_search(), 3, jobs)}
    alone = searched(1)
    assert len(alone) == 4 and all(rate > 0 for rate, _ in alone.values())
    assert searched(2) == alone


def test_a_plan_stopped_early_leaves_no_search_running():
    found = plan(small_search(), 3, jobs=2)
    next(found)
    found.close()  # as a Ctrl-C in the command leaves it: its processes terminated
    assert multiprocessing.active_children() == []


def test_a_stopped_plan_keeps_the_shapes_it_found(tmp_path):
    """As a user runs it (output not a terminal: no bar, no probe lines): each shape's
    row is printed and written as it ends; a run stopped after the first keeps it."""
    small_profile().save(tmp_path / "profile.json")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "sim", "plan", "--budget", "4", "--profile",
         str(tmp_path / "profile.json"), "--workload", "azure-conv", "--scale", "0.25",
         "--num-prompts", "40", "--min-duration", "3", "--iterations", "3",
         "--first-rate", "4", "--goodput", "ttft:300", "tpot:30", "--jobs", "1",
         "--out-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        row = next(line for line in process.stdout if line.startswith("| ")
                   and not line.startswith("| pools"))
    finally:
        process.kill()
        _, err = process.communicate(timeout=30)
    written = json.loads((tmp_path / "plan.json").read_text())
    first = row.split("|")[1].strip()
    assert not written["complete"] and [s["pools"] for s in written["shapes"]] == [first]
    assert f"{written['shapes'][0]['max_rate']:.2f}" in row
    assert "req/s holds" not in err and "shapes" not in err  # quiet off a terminal


def test_a_shape_s_pools_run_on_their_own_tensor_parallel_size_s_profile():
    """A prefill pool of TP-2 workers beside TP-1 decode workers: each worker's steps
    take its own profile's time, and the goodput is per device (3 here)."""
    from dataclasses import replace

    from pdserve.sim import virtual_time
    from pdserve.sim.cluster import SimCluster
    one = small_profile()
    two = replace(one, tensor_parallel_size=2, step_cost=replace(
        one.step_cost, prefill_token_s=one.step_cost.prefill_token_s / 2))
    setup = Setup(profile=one, pools=PoolSpec(1, 1), prefill_profile=two)
    assert setup.num_devices == 3

    async def started() -> dict:
        cluster = SimCluster(one, PoolSpec(1, 1), prefill_profile=two)
        await cluster.start()
        try:
            return {w.role: w.profile.tensor_parallel_size for w in cluster.workers.values()}
        finally:
            await cluster.stop()
    with virtual_time.sim_collector():
        assert virtual_time.run(started()) == {"prefill": 2, "decode": 1}
    # A transfer takes the slower side's time: here the TP-1 decode worker's NIC.
    from pdserve.sim.worker import SimWorker
    fast = replace(two, transfer_cost=replace(one.transfer_cost,
                                              per_byte_s=one.transfer_cost.per_byte_s / 2))
    sender = SimWorker("prefill-0", "prefill", fast, setup.scheduler, {})
    receiver = SimWorker("decode-0", "decode", one, setup.scheduler, {})
    assert sender.transfer_seconds(1 << 30, receiver) == one.transfer_cost.seconds(1 << 30)
    assert sender.transfer_seconds(1 << 30, None) == fast.transfer_cost.seconds(1 << 30)
    search = replace(small_search(), profiles=((1, one), (2, two)))
    found = search.run(Shape(PoolSpec(1, 1), prefill_tp=2, decode_tp=1), None)
    assert found.name == "1P:1D TP 2:1" and found.devices == 3
    assert found.max_rate > 0 and found.goodput_per_device == found.max_rate / 3
    with pytest.raises(ValueError, match="same model and blocks"):
        SimCluster(one, PoolSpec(1, 1), prefill_profile=replace(two, block_size=32))


def test_the_command_searches_each_pool_s_tensor_parallel_size(tmp_path, capsys):
    """An analytic 70B on 8 H100s: sizes it does not fit are left out, saying why; each
    shape's row names its sizes and devices."""
    assert main(["sim", "plan", "--budget", "8", "--model", "llama-3-70b", "--profile",
                 "analytic:h100", "--tensor-parallel-sizes", "2", "4", "8",
                 "--workload", "azure-code", "--scale", "0.1", "--num-prompts", "40",
                 "--min-duration", "2", "--iterations", "2", "--first-rate", "2",
                 "--goodput", "ttft:1000", "tpot:100", "--jobs", "1",
                 "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size 2 left out: pdserve sim: llama-3-70b does not fit 2 x" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    found = {s["pools"]: (s["devices"], s["prefill_tensor_parallel_size"],
                          s["decode_tensor_parallel_size"]) for s in plan["shapes"]}
    assert found == {"1P:1D TP 4:4": (8, 4, 4), "colocated x2 TP 4": (8, 4, 4),
                     "adaptive x2 TP 4": (8, 4, 4), "colocated x1 TP 8": (8, 8, 8)}
    per_device = [s["goodput_per_device"] for s in plan["shapes"]]
    assert per_device == sorted(per_device, reverse=True) and per_device[0] > 0


@pytest.mark.parametrize("sizes", [["--tensor-parallel-sizes", "4"],
                                   ["--tensor-parallel-size", "4"]])
def test_one_size_above_one_still_spends_devices(tmp_path, sizes):
    """A plan of TP-4 workers alone: 8 devices are 2 workers, not 8 of them."""
    assert main(["sim", "plan", "--budget", "8", "--model", "llama-3-70b", "--profile",
                 "analytic:h100", *sizes, "--workload", "azure-code", "--scale", "0.1",
                 "--num-prompts", "40", "--min-duration", "2", "--iterations", "1",
                 "--first-rate", "2", "--goodput", "ttft:1000", "tpot:100", "--jobs", "1",
                 "--out-dir", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert sorted((s["pools"], s["devices"]) for s in plan["shapes"]) == [
        ("1P:1D TP 4:4", 8), ("adaptive x2 TP 4", 8), ("colocated x2 TP 4", 8)]


def test_bad_sizes_and_budgets_exit_naming_the_flag():
    base = ["sim", "plan", "--model", "llama-3-70b", "--profile", "analytic:h100",
            "--goodput", "ttft:500", "tpot:50"]
    with pytest.raises(SystemExit, match="tensor_parallel_size must be >= 1, not 0"):
        main([*base, "--budget", "8", "--tensor-parallel-size", "0"])
    with pytest.raises(SystemExit, match="--budget: a plan needs a budget of at least 8 "
                                         "devices"):
        main([*base, "--budget", "4", "--tensor-parallel-sizes", "4", "8"])
