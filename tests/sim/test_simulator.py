"""The simulator (`pdserve sim`): every request finishes or is refused and nothing is
left held; a lone request's TTFT is the latency model's forecast for its profile;
the same seed gives a byte-identical report; and what decides is the production
scheduler, policy and latency model, not a copy."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import BenchRequest, iter_workload, make_workload
from pdserve.engine.latency_model import StepCost
from pdserve.engine.scheduler import Scheduler
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.policy import decide, goodput
from pdserve.router.policy.latency_forecast import WorkerLoad, ttft_seconds
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from pdserve.sim.driver import Load, drive
from pdserve.sim.run import Setup, simulate
from tests.sim.sims import COST, LINK, small_profile


def _run_and_inspect(mode: str, requests, load: Load, profile):
    async def scenario():
        cluster = SimCluster(profile, PoolSpec(1, 1, mode=mode))
        router = await cluster.start()
        records, duration = await drive(router, requests, load)
        held = [(w.worker_id, w.blocks.num_free_blocks, w.blocks.num_blocks,
                 len(w.scheduler.requests)) for w in cluster.workers.values()]
        counts = [(h.state.inflight, h.state.queued, len(h.flights))
                  for h in router.workers.values()]
        await cluster.stop()
        return records, held, counts, router.num_inflight
    return virtual_time.run(scenario())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "adaptive"])
def test_every_request_finishes_or_is_refused_and_every_block_is_free_at_the_end(mode):
    profile = small_profile(num_kv_blocks=300, noise=0.05, max_model_len=4096)
    requests = make_workload("azure-conv", 120, profile.vocab_size, seed=3, scale=0.25)
    records, held, counts, inflight = _run_and_inspect(
        mode, requests, Load(request_rate=150.0, slo=SLO(ttft_ms=300, tpot_ms=30)), profile)
    assert all(r.error is None for r in records), [r.error for r in records if r.error][:3]
    assert all(r.rejected or (r.end_time is not None and r.num_output_tokens == q.max_tokens)
               for r, q in zip(records, requests))
    assert any(r.rejected for r in records) and any(not r.rejected for r in records)
    assert all(free == total and not requests_left for _, free, total, requests_left in held)
    assert all(c == (0, 0, 0) for c in counts) and inflight == 0


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_lone_request_s_ttft_is_the_latency_model_s_forecast_for_its_profile(mode):
    """Idle workers, no noise: the first token comes when the profile's step cost
    says (chunked as the scheduler chunks), plus, split, the transfer of the blocks
    the decode side does not hold."""
    profile = small_profile()
    prompt = list(range(10, 10 + 700))
    (record,), _, _, _ = _run_and_inspect(mode, [BenchRequest(prompt, max_tokens=8)], Load(),
                                          profile)
    forecast = ttft_seconds(COST, WorkerLoad(), len(prompt))
    if mode == "disaggregated":
        forecast += LINK.seconds(-(-len(prompt) // 16) * profile.kv_bytes_per_block)
    assert record.ttft == pytest.approx(forecast, rel=1e-9)


def test_the_same_seed_gives_a_byte_identical_report(tmp_path):
    """Two processes with different string hashing run the same simulation: the JSON
    reports are the same bytes (and a different seed's are not)."""
    def report(seed: int, hash_seed: str) -> bytes:
        out = tmp_path / f"{seed}-{hash_seed}"
        subprocess.run([sys.executable, "-m", "pdserve", "sim", "--mode", "adaptive",
                        "--prefill-workers", "2", "--decode-workers", "2",
                        "--workload", "conversations", "--num-prompts", "80",
                        "--request-rate", "30", "--goodput", "ttft:400", "tpot:40",
                        "--seed", str(seed), "--out-dir", str(out)],
                       check=True, capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": hash_seed})
        return (out / "sim.json").read_bytes()
    first = report(7, "1")
    assert report(7, "2") == first
    assert report(8, "1") != first
    assert json.loads(first)["requests"] == 80


def test_a_drawn_workload_is_held_only_while_in_flight_and_reports_as_its_list_does():
    """A long run draws each request as it is due and lets it go when it ends (a
    list of ten minutes of a large cluster's prompts did not fit in memory)."""
    profile = small_profile()
    setup = Setup(profile=profile, pools=PoolSpec(2, 0, mode="colocated"))
    load = Load(request_rate=40.0, slo=SLO(ttft_ms=500, tpot_ms=50))

    def draw():
        return iter_workload("random", 300, profile.vocab_size, seed=2, input_len=200,
                             output_len=20)
    alive, most = [], 0

    def watched():
        nonlocal most
        for request in draw():
            alive[:] = [ref for ref in alive if ref() is not None]
            most = max(most, len(alive))
            alive.append(weakref.ref(request))
            yield request
    lazily = simulate(setup, watched(), load)
    assert lazily["completed"] == 300 and most < 30, (lazily["completed"], most)
    assert lazily == simulate(setup, list(draw()), load)


def test_the_production_scheduler_policy_and_latency_model_decide(monkeypatch):
    """Counted where they are defined: a copy of any of them in the simulator would
    leave its count at zero."""
    calls = {"schedule": 0, "update": 0, "goodput": 0, "forecast": 0, "duration": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(Scheduler, "schedule", counted("schedule", Scheduler.schedule))
    monkeypatch.setattr(Scheduler, "update", counted("update", Scheduler.update))
    monkeypatch.setitem(decide.POLICIES, "goodput", counted("goodput", goodput.decide))
    monkeypatch.setattr(goodput, "ttft_seconds", counted("forecast", goodput.ttft_seconds))
    monkeypatch.setattr(StepCost, "duration", counted("duration", StepCost.duration))
    profile = small_profile()
    summary = simulate(Setup(profile=profile, pools=PoolSpec(1, 1, mode="adaptive"),
                             router=RouterConfig(routing=RoutingSpec())),
                       make_workload("random", 20, profile.vocab_size, input_len=200,
                                     output_len=10),
                       Load(request_rate=20.0, slo=SLO(ttft_ms=500, tpot_ms=50)))
    assert summary["completed"] == 20
    assert all(count > 0 for count in calls.values()), calls


def test_a_simulation_collects_cycles_at_its_own_thresholds_and_restores_the_process_s():
    before = gc.get_threshold()

    async def inside():
        return gc.get_threshold()
    assert virtual_time.run(inside()) == virtual_time.SIM_GC_THRESHOLDS != before
    assert gc.get_threshold() == before
