"""API keys and TLS end to end: HTTPS (raw, the openai client), gRPC over TLS (the
SDK), pdserve bench on both backends; probes stay open; a request can be aborted only
by the caller that made it. The certificate comes from a CA the test makes (trustme)."""
from __future__ import annotations

import asyncio
import json
import ssl

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli import main
from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.engine.config import EngineConfig
from pdserve.router.config import PoolSpec, TLSConfig
from pdserve.router.front.auth import ApiKeys
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free

KEY = "sk-test-8f1c2d"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    authority = trustme.CA()
    cert = authority.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    authority.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    return paths


@pytest.fixture(scope="module")
def locked(ray_local, llama_dir, ca):
    """One colocated engine worker behind TLS front ends that require a key."""
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router = launch(config, PoolSpec(0, 1, mode="colocated"), served_model_name="test-llama")
    srv = RouterServer(router, keys=ApiKeys((KEY,)), tls=TLSConfig(ca["cert"], ca["key"]))
    yield srv
    stop_cluster(srv)


@pytest.fixture(scope="module")
def verify(ca):
    return ssl.create_default_context(cafile=ca["ca"])


def test_https_needs_the_key_and_probes_do_not(locked, verify):
    assert locked.http_url.startswith("https://")
    body = {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
    url = f"{locked.http_url}/v1/completions"
    with httpx.Client(verify=verify, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            refused = http.post(url, json=body, headers=headers)
            assert refused.status_code == 401, headers
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get(f"{locked.http_url}/metrics").status_code == 401
        assert http.get(f"{locked.http_url}/health").status_code == 200
        assert http.get(f"{locked.http_url}/ready").status_code == 200
        assert http.get(f"{locked.http_url}/live").status_code == 200
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(f"{locked.http_url}/health", timeout=30)
    client = openai.OpenAI(base_url=f"{locked.http_url}/v1", api_key=KEY, max_retries=0,
                           http_client=httpx.Client(verify=verify))
    out = client.completions.create(model="test-llama", prompt=[5, 6], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_grpc_over_tls_needs_the_key_and_health_does_not(locked, ca):
    with Client(locked.grpc_target, api_key="wrong", ca_file=ca["ca"]) as client:
        with pytest.raises(PdserveError) as err:
            client.generate([5, 6], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(locked.grpc_target, api_key=KEY, ca_file=ca["ca"]) as client:
        assert len(client.generate([5, 6], max_tokens=2, ignore_eos=True).token_ids) == 2
    with Client(locked.grpc_target, api_key=KEY, timeout=5, max_retries=0) as plain:
        with pytest.raises(PdserveError):  # plaintext against a TLS port
            plain.generate([5, 6], max_tokens=2)
    credentials = grpc.ssl_channel_credentials(open(ca["ca"], "rb").read())
    with grpc.secure_channel(locked.grpc_target, credentials) as channel:
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


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_sends_the_key_over_tls(locked, ca, tmp_path, backend):
    target = locked.grpc_target if backend == "grpc" else locked.http_url
    extra = ["--model", "test-llama", "--vocab-size", "1000"] if backend == "openai" else []
    assert main(["bench", "run", "--backend", backend, "--target", target, "--api-key", KEY,
                 "--ca-file", ca["ca"], "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--out-dir", str(tmp_path), "--name", backend,
                 *extra]) == 0
    assert json.loads((tmp_path / f"{backend}.json").read_text())["completed"] == 3
