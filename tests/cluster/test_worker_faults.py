"""Step errors on a real cluster. One that the engine pins on a request (injected at
the decode worker's sampler) fails that request alone, with a 500 / INTERNAL naming
the cause, or an SSE error event then [DONE] once it streams; every other request's
tokens are exact and the worker keeps serving. One it cannot pin (injected in the
forward pass) ends the worker's process: with --migration-limit 0 (requests do not
move: test_migration.py) its requests get a typed error, health goes
NOT_SERVING / 503, Ray restarts the actor, and the router pairs it and serves again.
A frozen worker (SIGSTOP) is reported stalled and given nothing until it reports."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import AsyncClient, PdserveError
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests import faults
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free

PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [9] * 30, list(range(100, 117))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router = launch(config, PoolSpec(1, 1), TransferConfig(timeout_s=30),
                    RouterConfig(revive_timeout_s=120,  # --migration-limit 0: they fail
                                 routing=RoutingSpec(migration_limit=0)),
                    served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    stop_cluster(srv)


async def complete_all(srv: RouterServer, prompts) -> list:
    async with AsyncClient(srv.grpc_target) as client:
        return await asyncio.gather(*[client.generate(
            p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for p in prompts])


def events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.text.splitlines()
            if line.startswith("data: ")]


def test_a_step_error_pinned_on_one_request_fails_it_alone(cluster):
    expected = [out.token_ids for out in asyncio.run(complete_all(cluster, PROMPTS))]
    decode = next(iter(cluster.router.pool.decode.values())).client.actor
    ray.get(decode.__ray_call__.remote(faults.poison_sampler))
    poison = [faults.POISON, 5, 6, 7]
    body = {"prompt": poison, "max_tokens": MAX_TOKENS, "ignore_eos": True}

    async def mixed():
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as http, \
                AsyncClient(cluster.grpc_target) as client:
            good = asyncio.gather(*[client.generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True) for p in PROMPTS])

            async def poisoned():
                # One at a time, beside the good ones: a step whose rows all fail, of
                # several, is no one request's doing (the runner re-raises it), and two
                # poisoned requests that outlived the good ones met in such a step once.
                plain = await http.post("/v1/completions", json=body)
                streamed = await http.post("/v1/completions", json={**body, "stream": True})
                try:
                    over_grpc = await client.generate(poison, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True)
                except PdserveError as error:
                    over_grpc = error
                return plain, streamed, over_grpc
            return await asyncio.gather(good, poisoned(), return_exceptions=True)

    good, (plain, streamed, over_grpc) = asyncio.run(mixed())
    assert [out.token_ids for out in good] == expected
    assert plain.status_code == 500, plain.text
    assert plain.json()["error"]["type"] == "server_error"
    assert "injected fault" in plain.json()["error"]["message"]
    assert streamed.status_code == 200
    sse = events(streamed)
    assert json.loads(sse[0])["choices"][0]["text"] is not None  # token 1, from prefill
    assert json.loads(sse[-2])["error"]["code"] == 500 and sse[-1] == "[DONE]"
    assert isinstance(over_grpc, PdserveError) and over_grpc.code == grpc.StatusCode.INTERNAL
    assert "injected fault" in str(over_grpc)
    assert set(cluster.router.worker_states().values()) == {"serving"}
    wait_all_blocks_free(cluster)


def test_an_unpinned_step_error_restarts_the_worker_and_service_resumes(cluster):
    expected = [out.token_ids for out in asyncio.run(complete_all(cluster, PROMPTS))]
    decode = next(iter(cluster.router.pool.decode.values())).client
    old_pid = ray.get(decode.actor.__ray_call__.remote(lambda actor: __import__("os").getpid()))
    health_seen = []

    async def scenario():
        channel = grpc.aio.insecure_channel(cluster.grpc_target)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        statuses = [(await watch.read()).status]  # SERVING
        await decode.actor.__ray_call__.remote(faults.break_forward)
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as http:
            failed = await http.post("/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "ignore_eos": True})
            statuses.append((await watch.read()).status)  # NOT_SERVING: decode died
            while (health := await http.get("/health")).status_code == 503:
                health_seen.append(health.json())
            statuses.append((await watch.read()).status)  # SERVING again
        watch.cancel()
        await channel.close()
        return failed, statuses

    failed, statuses = asyncio.run(scenario())
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["type"] == "service_unavailable"
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    assert statuses == [serving, not_serving, serving]
    assert health_seen and health_seen[0]["workers"]["decode-0"] == "restarting"
    assert cluster.router.worker_states() == {"prefill-0": "serving", "decode-0": "serving"}
    new_pid = ray.get(decode.actor.__ray_call__.remote(lambda actor: __import__("os").getpid()))
    assert new_pid != old_pid
    assert [out.token_ids for out in asyncio.run(complete_all(cluster, PROMPTS))] == expected
    wait_all_blocks_free(cluster)


def test_a_frozen_worker_is_reported_stalled_and_given_nothing_until_it_reports(cluster):
    """SIGSTOP the decode worker's process: once nothing came from it for
    telemetry_stale_s, health says so (gRPC NOT_SERVING; /health 503 naming it
    stalled, /ready 503; /live, the liveness probe's, still 200), a new request is
    refused at once (429, nothing placed on it), and its requests do not fail;
    SIGCONT: it serves again, exactly."""
    expected = [out.token_ids for out in asyncio.run(complete_all(cluster, PROMPTS))]
    handle = next(iter(cluster.router.pool.decode.values()))
    pid = ray.get(handle.client.actor.__ray_call__.remote(
        lambda actor: __import__("os").getpid()))
    stale_s = cluster.router.config.telemetry_stale_s

    async def scenario():
        channel = grpc.aio.insecure_channel(cluster.grpc_target)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        statuses = [(await watch.read()).status]  # SERVING
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            statuses.append((await watch.read()).status)  # NOT_SERVING: it went silent
            noticed_s = time.monotonic() - stopped
            async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as http:
                health, ready = await http.get("/health"), await http.get("/ready")
                live = await http.get("/live")
                asked = time.monotonic()
                refused = await http.post("/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "ignore_eos": True})
                refused_s = time.monotonic() - asked
                placed = handle.state.inflight
        finally:
            os.kill(pid, signal.SIGCONT)
        statuses.append((await watch.read()).status)  # SERVING: it reports again
        watch.cancel()
        await channel.close()
        return statuses, noticed_s, health, ready, live, refused, refused_s, placed

    statuses, noticed_s, health, ready, live, refused, refused_s, placed = asyncio.run(
        scenario())
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    assert statuses == [serving, not_serving, serving]
    assert noticed_s < stale_s + 1.0
    assert health.status_code == 503 and health.json()["workers"]["decode-0"] == "stalled"
    assert ready.status_code == 503
    assert live.status_code == 200
    assert refused.status_code == 429 and "retry-after" in refused.headers, refused.text
    assert refused_s < 1.0 and placed == 0
    assert cluster.router.worker_states() == {"prefill-0": "serving", "decode-0": "serving"}
    assert [out.token_ids for out in asyncio.run(complete_all(cluster, PROMPTS))] == expected
    wait_all_blocks_free(cluster)
