"""Colocated mode (the goodput baseline): engine workers that do both phases with
chunked prefill, behind the same router and APIs. Greedy outputs equal HF."""
from __future__ import annotations

import asyncio
import random

import httpx

from pdserve.client import AsyncClient
from tests.cluster.conftest import generate_concurrently, wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle


def test_colocated_runs_two_engine_workers_and_matches_hf(colocated_server, llama_dir):
    router = colocated_server.router
    assert not router.pool.prefill and len(router.pool.decode) == 2
    oracle = Oracle(llama_dir)
    rng = random.Random(41)
    prompts = [[rng.randrange(4, 2000) for _ in range(n)] for n in (6, 33, 70, 140, 21, 90)]
    outs = generate_concurrently(colocated_server, prompts, 9)
    for prompt, out in zip(prompts, outs):
        expected, _ = oracle.generate(prompt, 9)
        assert out.token_ids == expected
    http = httpx.post(f"{colocated_server.http_url}/v1/completions",
                      json={"prompt": prompts[2], "max_tokens": 9, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert http.json()["choices"][0]["token_ids"] == oracle.generate(prompts[2], 9)[0]
    assert httpx.get(f"{colocated_server.http_url}/ready").status_code == 200


def test_colocated_cancel_frees_blocks(colocated_server):
    async def cancel():
        async with AsyncClient(colocated_server.grpc_target) as client:
            async for chunk in client.generate_stream(list(range(30, 90)), max_tokens=400,
                                                      ignore_eos=True):
                if chunk.token_ids:
                    break

    asyncio.run(cancel())
    wait_all_blocks_free(colocated_server)
