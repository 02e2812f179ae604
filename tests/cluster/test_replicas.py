"""Two router replicas over one pool, sharing state in a real Redis (--redis-url): an
id in flight on one is refused by the other, an abort sent to the other ends the
request streaming on the first and frees its KV, and of the two planners one leads
(the other takes over when it goes)."""
from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient, InvalidArgumentError
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.auth import ApiKeys
from pdserve.router.config import AutoscaleSpec, PoolSpec, RouterConfig, SharedStateSpec
from pdserve.router.launch import launch
from pdserve.router.redis_directory import RedisDirectory
from pdserve.router.server import RouterServer
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free
from tests.cluster.test_shared_pool import second_router
from tests.polling import until
from tests.redis_server import RedisServer

KEY = "replica-key"  # the same caller on both replicas: the owner is the key's digest


@pytest.fixture(scope="module")
def replicas(ray_local, llama_dir, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      max_model_len=512)
    # --autoscale with each pool's bounds at its size: both planners run, neither acts
    shared = RouterConfig(
        shared=SharedStateSpec(redis_url=redis.url, redis_prefix="r", leader_ttl_s=2.0),
        autoscale=AutoscaleSpec(autoscale=True, max_prefill_workers=1, max_decode_workers=1,
                                max_workers=2))
    keys = ApiKeys((KEY,))
    first = RouterServer(launch(config, PoolSpec(1, 1), TransferConfig(timeout_s=30), shared),
                         keys=keys)
    second = RouterServer(second_router(first.router), keys=keys)
    for srv in (first, second):
        assert isinstance(srv.router.directory, RedisDirectory)
    yield first, second
    second.stop()
    stop_cluster(first)
    redis.kill()


def test_an_id_in_flight_on_one_replica_is_refused_by_the_other(replicas, llama_dir):
    first, second = replicas
    prompt = [5, 6, 7, 8, 9]
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=512)
    expected = llm.generate([prompt], SamplingParams(max_tokens=300, temperature=0,
                                                     ignore_eos=True))[0].token_ids

    async def collide():
        async with AsyncClient(first.grpc_target, api_key=KEY) as a, \
                AsyncClient(second.grpc_target, api_key=KEY) as b:
            chunks = a.generate_stream(prompt, request_id="shared-id", max_tokens=300,
                                       temperature=0, ignore_eos=True)
            tokens = list((await chunks.__anext__()).token_ids)
            with pytest.raises(InvalidArgumentError) as err:
                await b.generate([11, 12], request_id="shared-id", max_tokens=4)
            async for chunk in chunks:
                tokens += chunk.token_ids
            return tokens, err.value

    async def reuse():
        async with AsyncClient(second.grpc_target, api_key=KEY) as b:
            return await b.generate([11, 12], request_id="shared-id", max_tokens=4,
                                    temperature=0, ignore_eos=True)

    tokens, err = asyncio.run(collide())
    assert tokens == expected
    assert "already in flight on another router" in str(err)
    # Released when it ended (after its last chunk went out: the entry goes within a
    # round trip), the id is free again on every replica.
    directory = first.router.directory
    assert until(lambda: first._run(directory.client.get(directory.key("shared-id")),
                                    timeout=5) is None, timeout_s=10)
    assert len(asyncio.run(reuse()).token_ids) == 4
    wait_all_blocks_free(first)


def test_an_abort_sent_to_another_replica_ends_the_stream_and_frees_its_kv(replicas):
    first, second = replicas

    async def abort_across():
        async with AsyncClient(first.grpc_target, api_key=KEY) as a, \
                AsyncClient(second.grpc_target, api_key=KEY) as b:
            chunks = a.generate_stream([3, 4, 5, 6], request_id="long", max_tokens=450,
                                       temperature=0, ignore_eos=True)
            received = [await chunks.__anext__()]
            found = await b.abort("long")
            async for chunk in chunks:
                received.append(chunk)
            other = await b.abort("never-was")
            return found, received, other

    found, received, other = asyncio.run(abort_across())
    assert found and not other
    assert received[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in received) < 450
    assert first.router.num_inflight == 0
    wait_all_blocks_free(first)


def test_one_replica_s_planner_leads_and_the_other_takes_over_when_it_goes(replicas):
    planners = [srv.router.planner for srv in replicas]
    assert until(lambda: sum(p.lease.leading for p in planners) == 1, timeout_s=10)
    leader = next(i for i, p in enumerate(planners) if p.lease.leading)
    other = planners[1 - leader]
    assert not other.lease.leading and other.describe()["leading"] is False
    token = planners[leader].lease.token
    srv = replicas[leader]
    srv._run(planners[leader].lease.stop(), timeout=10)  # as when its router ends
    assert until(lambda: other.lease.leading, timeout_s=3 * 2.0)
    assert other.lease.token > token
