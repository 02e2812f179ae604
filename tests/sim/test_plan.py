"""`pdserve sim plan`: every shape of a budget is searched, and each search ends on a
rate that holds the SLOs with the next rate probed above it failing."""
from __future__ import annotations

import json

from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import make_workload
from pdserve.cli import main
from pdserve.router.config import PoolSpec
from pdserve.sim.driver import Load
from pdserve.sim.plan import max_rate, shapes
from pdserve.sim.run import Setup
from tests.sim.sims import small_profile


def test_a_budget_s_shapes_are_every_split_colocated_and_adaptive():
    found = [(p.mode, p.prefill_workers, p.decode_workers) for p in shapes(4)]
    assert found == [("disaggregated", 1, 3), ("disaggregated", 2, 2),
                     ("disaggregated", 3, 1), ("colocated", 0, 4), ("adaptive", 0, 4)]


def test_the_search_brackets_the_highest_rate_that_holds():
    profile = small_profile()
    slo = SLO(ttft_ms=300, tpot_ms=30)
    found = max_rate(Setup(profile=profile, pools=PoolSpec(0, 2, mode="colocated")),
                     lambda n: make_workload("azure-conv", n, profile.vocab_size, 1, 0.25),
                     Load(slo=slo), first_rate=4.0, iterations=3, min_requests=60,
                     min_duration_s=5.0)
    held = [p for p in found.probes if p.attainment >= 0.9]
    failed = [p for p in found.probes if p.attainment < 0.9]
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
