"""Two routers on one pool of workers: each subscribes to the decode worker's steps
under its own id and gets exactly its own requests' tokens, so concurrent requests
through both are exact (greedy, the in-process engine as reference)."""
from __future__ import annotations

import asyncio
import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient, InvalidArgumentError
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.router import Router
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free

MAX_TOKENS = 16


def second_router(router: Router) -> Router:
    """Another router over the same worker actors (its own handles and counts)."""
    return Router(router.tokenizer, router.model,
                  [WorkerHandle.of(w.worker_id, w.client, w.state.role, w.state.num_blocks,
                                   w.address)
                   for w in router.workers.values()], router.config)


@pytest.fixture(scope="module")
def two_routers(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      max_model_len=512)
    first = RouterServer(launch(config, PoolSpec(1, 1), TransferConfig(timeout_s=30)))
    second = RouterServer(second_router(first.router))
    yield first, second
    second.stop()
    stop_cluster(first)


def test_each_router_gets_exactly_its_own_requests_tokens(two_routers, llama_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 2000) for _ in range(rng.randrange(8, 80))] for _ in range(16)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=512)
    expected = [out.token_ids for out in llm.generate(prompts, params)]

    async def both():
        async with AsyncClient(two_routers[0].grpc_target) as a, \
                AsyncClient(two_routers[1].grpc_target) as b:
            return await asyncio.gather(*[
                (a if i % 2 else b).generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                             ignore_eos=True)
                for i, p in enumerate(prompts)])

    outs = asyncio.run(both())
    assert [out.token_ids for out in outs] == expected
    for srv in two_routers:
        assert srv.router.num_inflight == 0
    wait_all_blocks_free(two_routers[0])


def test_an_id_one_router_has_in_flight_is_refused_to_the_other(two_routers, llama_dir):
    # The second router's reservation of the same id must neither take over nor
    # abort the first router's request: it is refused, and the first finishes exact.
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=512)
    expected = llm.generate([prompt], params)[0].token_ids

    async def collide():
        async with AsyncClient(two_routers[0].grpc_target) as a, \
                AsyncClient(two_routers[1].grpc_target) as b:
            chunks = a.generate_stream(prompt, request_id="shared-id", max_tokens=400,
                                       temperature=0, ignore_eos=True)
            tokens = list((await chunks.__anext__()).token_ids)  # in flight on the worker
            with pytest.raises(InvalidArgumentError) as err:
                await b.generate([11, 12], request_id="shared-id", max_tokens=4)
            async for chunk in chunks:
                tokens += chunk.token_ids
            return tokens, err.value

    tokens, err = asyncio.run(collide())
    assert tokens == expected and "already in use" in str(err)
    wait_all_blocks_free(two_routers[0])
