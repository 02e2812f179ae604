"""Sessions through the simulator: a session's turn k+1 goes out at turn k's end plus
its think time on the virtual clock, its prompt the last one and the reply the worker
made, so the history's blocks are prefix hits; `pdserve sim --workload sessions`
reports by turn."""
from __future__ import annotations

import json

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.sessions import SessionShape
from pdserve.bench.workloads import make_workload
from pdserve.cli import main
from pdserve.router.config import PoolSpec
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from pdserve.sim.driver import Load, drive
from tests.sim.sims import small_profile


def think_times(session) -> list[float]:
    """The think time before each of the session's turns after the first (drawn the
    same whatever the replies: they change a prompt's tokens, never its length)."""
    session.first_turn()
    times = []
    while (following := session.next_turn([])) is not None:
        times.append(following[0])
    return times


def test_turn_k_plus_1_goes_out_at_turn_k_s_end_plus_its_think_time_and_hits_its_history():
    profile = small_profile(num_kv_blocks=4096, max_model_len=1024)

    def draw():
        return make_workload("sessions", 12, profile.vocab_size, seed=5, scale=0.05,
                             sessions=SessionShape(mean_turns=4, think_s=1.0,
                                                   max_model_len=profile.max_model_len))
    expected = [think_times(s) for s in draw()]

    async def scenario():
        cluster = SimCluster(profile, PoolSpec(1, 0, mode="colocated"))
        router = await cluster.start()
        try:
            return await drive(router, draw(), Load(request_rate=4.0,
                                                    slo=SLO(ttft_ms=500, tpot_ms=50)))
        finally:
            await cluster.stop()
    records, _ = virtual_time.run(scenario())
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    assert max(len(t) for t in expected) >= 2, "a session of three turns at least"
    for number, thinks in enumerate(expected):
        turns = [r for r in records if r.session == number]
        assert [r.turn for r in turns] == list(range(1, len(thinks) + 2))
        for last, this, think_s in zip(turns, turns[1:], thinks):
            assert this.send_time >= last.end_time + think_s - 1e-9
            assert this.send_time == pytest.approx(last.end_time + think_s)
            # its history (the last prompt and the reply the worker made) was computed
            # there: every full block of it but the reply's last token is a hit
            history = last.num_prompt_tokens + last.num_output_tokens - 1
            assert this.num_cached_tokens == history // 16 * 16
        assert turns[0].num_cached_tokens == 0


def test_pdserve_sim_takes_the_sessions_workload_and_reports_by_turn(tmp_path, capsys):
    assert main(["sim", "--mode", "adaptive", "--prefill-workers", "1", "--decode-workers",
                 "1", "--workload", "sessions", "--num-prompts", "8", "--scale", "0.1",
                 "--session-turns", "3", "--think-time", "0.5", "--request-rate", "2",
                 "--goodput", "ttft:500", "tpot:50", "--seed", "1", "--quiet",
                 "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "sim.json").read_text())
    assert (report["workload"], report["session_turns"], report["think_time"]) == (
        "sessions", 3.0, 0.5)
    assert report["sessions"]["sessions"] == 8 == report["by_turn"]["1"]["requests"]
    assert report["sessions"]["turns"] == report["requests"] > 8
    assert report["by_turn"]["2"]["prefix_hit_share"]["device"] > 0
    assert "Sessions by turn" in capsys.readouterr().out
