"""deploy/ray/local.yaml's commands, run on this machine (conftest.py: what is changed
for loopback, and why): the router they start serves a request exactly as HF
transformers generates it, behind the API key sourced from ~/pdserve.env."""
from __future__ import annotations

import httpx

from pdserve.client import Client
from tests.engine.test_hf_oracle import Oracle

PROMPT = list(range(40, 72))
MAX_TOKENS = 8


def test_the_local_files_commands_serve_a_request_exactly_as_hf(local_cluster, llama_dir):
    expected, _ = Oracle(llama_dir).generate(PROMPT, MAX_TOKENS)
    url = local_cluster.http_url
    body = {"model": "test-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
    answer = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True},
                        headers={"Authorization": f"Bearer {local_cluster.api_key}"},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == expected
    with Client(local_cluster.grpc_target, api_key=local_cluster.api_key) as client:
        over_grpc = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    ignore_eos=True)
    assert over_grpc.token_ids == expected
    assert httpx.get(f"{url}/ready", timeout=30).status_code == 200
