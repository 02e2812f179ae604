"""The SLO planner live, on real Ray workers (`pdserve serve --autoscale`'s router):
a load step makes it grow the pool whose forecasts miss (a new worker or one
flipped in); when the load stops the pools return to their minima. Every output
equals HF's and no request fails. Its periods are shortened for a test (the
planner's own logic is tests/router/test_planner.py; its judgment, in the
simulator, benchmarks/planner.py)."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import httpx
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import AutoscaleSpec, PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.front.auth import ApiKeys
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.cluster.conftest import stop_cluster
from tests.cluster.test_membership import Load
from tests.polling import until

# Long prompts, short answers: the prefill pool is what a load of them fills. Idle, one
# is forecast at some 30-40 ms to its first token; six queued, several times that.
PROMPTS = [list(range(10 + 3 * i, 410 + 3 * i)) for i in range(4)]
MAX_TOKENS = 4
ADMIN_KEY = "admin-secret"


@pytest.fixture(scope="module")
def autoscaled(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router_config = RouterConfig(
        routing=RoutingSpec(admission="always", slo_ttft_ms=100),
        autoscale=AutoscaleSpec(autoscale=True, min_prefill_workers=1, max_prefill_workers=2,
                                min_decode_workers=1, max_decode_workers=2, max_workers=3,
                                planner_interval_s=0.5))
    router = launch(config, PoolSpec(1, 1, num_cpus_per_worker=0.5), TransferConfig(timeout_s=30),
                    router_config, served_model_name="test-llama")
    srv = RouterServer(router, admin_keys=ApiKeys((ADMIN_KEY,)))
    planner = srv.router.planner
    planner.config = replace(planner.config, sustain=2, down_sustain=4, cold_start_s=2.0,
                             reversal_guard_s=2.0, startup_s=5.0)
    yield srv
    stop_cluster(srv)


@pytest.fixture(scope="module")
def expected(llama_dir):
    from tests.engine.test_hf_oracle import Oracle
    oracle = Oracle(llama_dir)
    return [oracle.generate(p, MAX_TOKENS)[0] for p in PROMPTS]


def test_a_load_step_grows_the_pool_that_misses_and_it_shrinks_back(autoscaled, expected):
    srv, planner = autoscaled, autoscaled.router.planner
    pool = srv.router.pool

    def members() -> dict[str, int]:
        counts: dict[str, int] = {}
        for worker in list(srv.router.workers.values()):
            counts[worker.state.role] = counts.get(worker.state.role, 0) + 1
        return counts

    def grown() -> list[dict]:
        return [d for d in list(planner.decisions) if d["action"] in ("add", "flip")]
    def serving(role: str) -> int:
        states = srv.router.worker_states()
        return sum(1 for k, w in list(srv.router.workers.items())
                   if w.state.role == role and states.get(k) == "serving")
    load = Load(srv, expected, clients=6, prompts=PROMPTS, max_tokens=MAX_TOKENS)
    try:
        assert until(lambda: grown(), 90), planner.describe()
        step = grown()[0]
        # Under the load the grown pool gets its second worker into service.
        assert until(lambda: serving(step["role"]) == 2, 120), planner.describe()
        load.wait_for(6)  # served by the grown pool
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert not load.wrong
    assert step["cause"] in ("miss", "demand") and step["role"] in ("prefill", "decode")
    # the pools back at their minima, and every action's outcome recorded (a removed
    # worker leaves the pool before its remove has ended)
    assert until(lambda: members() == {"prefill": 1, "decode": 1} and not any(
        j.state != "failed" for j in list(pool.joining.values())) and not any(
        d["outcome"] == "under way" for d in list(planner.decisions)), 120), \
        (members(), planner.describe())
    shrunk = [d for d in list(planner.decisions) if d["action"] == "remove"]
    assert shrunk and all(d["cause"] == "spare" and d["outcome"] == "done" for d in shrunk), \
        planner.describe()["decisions"]


def test_the_planner_is_shown_paused_and_resumed_through_the_admin_api(autoscaled, capsys):
    from pdserve.cli import main
    url = autoscaled.http_url
    assert main(["admin", "--url", url, "--admin-api-key", ADMIN_KEY, "planner"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["bounds"] == {"prefill": [1, 2], "decode": [1, 2]} and not shown["paused"]
    assert set(shown["signals"]) == {"prefill", "decode"}
    assert any(d["action"] == "add" for d in shown["decisions"])  # the test before
    assert main(["admin", "--url", url, "--admin-api-key", ADMIN_KEY, "planner", "pause"]) == 0
    assert json.loads(capsys.readouterr().out)["paused"] and autoscaled.router.planner.paused
    assert main(["admin", "--url", url, "--admin-api-key", ADMIN_KEY, "planner",
                 "resume"]) == 0
    assert not json.loads(capsys.readouterr().out)["paused"]
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r'pdserve:planner_decisions_total\{action="add",model_name="test-llama",'
                     r'reason="(miss|demand)",role="prefill"\} 1\.0', metrics), metrics
    assert 'pdserve:pool_workers{model_name="test-llama",role="prefill",state="serving"} 1.0' \
        in metrics
