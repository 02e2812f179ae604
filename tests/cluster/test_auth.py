"""API keys end to end: HTTP (raw, the openai client), gRPC (the SDK), pdserve bench;
probes stay open; a request can be aborted only by the caller that made it."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli import main
from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.engine.config import EngineConfig
from pdserve.router.auth import ApiKeys
from pdserve.router.config import PoolSpec
from pdserve.router.launch import launch
from pdserve.router.server import RouterServer
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free

KEY = "sk-test-8f1c2d"


@pytest.fixture(scope="module")
def locked(ray_local, llama_dir):
    """One colocated engine worker behind front ends that require a key."""
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router = launch(config, PoolSpec(0, 1, mode="colocated"), served_model_name="test-llama")
    srv = RouterServer(router, keys=ApiKeys((KEY,)))
    yield srv
    stop_cluster(srv)


def test_http_needs_the_key_and_probes_do_not(locked):
    body = {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
    url = f"{locked.http_url}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = httpx.post(url, json=body, headers=headers, timeout=30)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{locked.http_url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{locked.http_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{locked.http_url}/ready", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{locked.http_url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="test-llama", prompt=[5, 6], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_grpc_needs_the_key_and_health_does_not(locked):
    with Client(locked.grpc_target, api_key="wrong") as client:
        with pytest.raises(PdserveError) as err:
            client.generate([5, 6], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(locked.grpc_target, api_key=KEY) as client:
        assert len(client.generate([5, 6], max_tokens=2, ignore_eos=True).token_ids) == 2
    with grpc.insecure_channel(locked.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_only_the_caller_that_made_a_request_can_abort_it(server):
    # Defect of #16: any client could abort any other client's request by id.
    async def scenario():
        async with AsyncClient(server.grpc_target) as owner_client, \
                AsyncClient(server.grpc_target) as stranger:
            stream = owner_client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True,
                                                  request_id="mine")
            first = await stream.__anext__()
            assert first.token_ids
            stolen = await stranger.abort("mine")
            own = await owner_client.abort("mine")
            rest = [chunk async for chunk in stream]
            return stolen, own, rest
    stolen, own, rest = asyncio.run(scenario())
    assert not stolen and own
    assert rest[-1].finish_reason == "abort"
    wait_all_blocks_free(server)


def test_bench_sends_the_key(locked, tmp_path, capsys):
    assert main(["bench", "run", "--target", locked.grpc_target, "--api-key", KEY,
                 "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                 "--out-dir", str(tmp_path), "--name", "auth"]) == 0
    assert json.loads((tmp_path / "auth.json").read_text())["completed"] == 3
