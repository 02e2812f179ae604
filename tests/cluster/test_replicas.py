"""Three router replicas over one pool, sharing state in a real Redis (--redis-url):
the second and third found the pool and its workers in the registry the first wrote
(`launch.join`, what `pdserve router` runs). An id in flight on one is refused by
another; an abort sent to another ends the request streaming on the first and frees
its KV; a prefix computed through one is found through the others; a worker added
through one's admin API gets traffic from all three; `pdserve router` as a process
serves, and SIGKILLed loses only its own request, whose KV the others free; Redis
killed under load fails nothing and is rebuilt when back; of the planners one leads
(another takes over when it goes)."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient, Client, InvalidArgumentError
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import AutoscaleSpec, PoolSpec, RouterConfig, SharedStateSpec
from pdserve.router.front.auth import ApiKeys
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import NAMESPACE, join, launch
from pdserve.router.policy.prefix_index import block_hashes
from pdserve.router.replicas.redis_directory import RedisDirectory
from pdserve.router.replicas.redis_registry import read_registered
from tests import faults
from tests.cluster.conftest import wait_all_blocks_free
from tests.front_process import FrontProcess
from tests.polling import eventually, until

REGISTRY_TTL_S = 5.0  # each replica sweeps for dead ones every third of it
KEY = "replica-key"  # the same caller on every replica: the owner is the key's digest
ADMIN = "replica-admin"


@pytest.fixture(scope="module")
def replicas(ray_local, llama_dir, redis):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      max_model_len=512)
    # --autoscale with each pool's bounds at its size: every planner runs, none acts
    # (the test that adds a decode worker pauses them)
    shared = RouterConfig(
        shared=SharedStateSpec(redis_url=redis.url, redis_prefix="r", leader_ttl_s=2.0,
                               registry_ttl_s=REGISTRY_TTL_S),
        autoscale=AutoscaleSpec(autoscale=True, min_prefill_workers=2, max_prefill_workers=2,
                                max_decode_workers=1, max_workers=3))
    keys, admin = ApiKeys((KEY,)), ApiKeys((ADMIN,))
    pools = PoolSpec(2, 1, num_cpus_per_worker=0.5)
    first = RouterServer(launch(config, pools, TransferConfig(timeout_s=30), shared),
                         keys=keys, admin_keys=admin)
    servers = [first]
    for _ in range(2):
        record, entries = read_registered(shared.shared)
        servers.append(RouterServer(join(record, entries, shared), keys=keys,
                                    admin_keys=admin))
    for srv in servers:
        assert isinstance(srv.router.directory, RedisDirectory)
        assert sorted(srv.router.workers) == ["decode-0", "prefill-0", "prefill-1"]
    yield servers
    for srv in servers[:0:-1]:
        srv.stop()
    assert not until(lambda: not named_workers(), timeout_s=2)  # the first serves on
    first.stop()  # the last replica: it ends the pool's (detached) workers
    assert until(lambda: not named_workers(), timeout_s=30), named_workers()


def named_workers() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE]


def pdserve_router(redis_url: str, *flags: str) -> FrontProcess:
    return FrontProcess("router", "--redis-url", redis_url, "--grpc-port", "0",
                        "--http-port", "0", *flags)


def test_pdserve_router_serves_the_registered_pool_as_another_replica(replicas, llama_dir):
    """The command users run: it finds the Ray cluster and the workers in the registry,
    serves exact outputs, refuses an id in flight on another replica, and on SIGTERM
    leaves the pool to the others (its workers serve on)."""
    redis_url = replicas[0].router.config.shared.redis_url
    with pdserve_router(redis_url, "--redis-prefix", "r", "--api-key", KEY) as process:
        target, _ = process.serving()
        prompt = [9, 8, 7, 6, 5]
        llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=512)
        want = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0,
                                                     ignore_eos=True))[0].token_ids
        with Client(target, api_key=KEY) as client, \
                Client(replicas[1].grpc_target, api_key=KEY) as other:
            stream = client.generate_stream(prompt, request_id="via-cli", max_tokens=200,
                                            temperature=0, ignore_eos=True)
            tokens = list(next(stream).token_ids)
            with pytest.raises(InvalidArgumentError, match="another router"):
                other.generate([1, 2], request_id="via-cli", max_tokens=2)
            tokens += [t for chunk in stream for t in chunk.token_ids]
        assert tokens == want
        assert process.terminate(timeout_s=60) == 0
    assert not process.tracebacks(), process.tracebacks()
    with Client(replicas[0].grpc_target, api_key=KEY) as client:  # the pool serves on
        assert len(client.generate([3, 4], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_replica_killed_mid_stream_loses_only_its_own_requests_and_frees_their_kv(
        replicas):
    """SIGKILL of a `pdserve router` while its request decodes: the other replicas serve
    on, and within the dead replica's heartbeat TTL one of them ends its request on the
    worker (a worker cannot see that a stream's reader died), so its KV is freed long
    before the request's 450 tokens would have been made."""
    redis_url = replicas[0].router.config.shared.redis_url
    decode = replicas[0].router.workers["decode-0"].client.actor
    ray.get(decode.__ray_call__.remote(faults.slow_sampler, 0.02))  # 450 steps: 9 s or more
    with pdserve_router(redis_url, "--redis-prefix", "r", "--api-key", KEY,
                        "--registry-ttl-s", "1.5") as process:
        target, _ = process.serving()
        with Client(target, api_key=KEY) as client:
            stream = client.generate_stream([faults.SLOW, 5, 6, 7], max_tokens=450,
                                            ignore_eos=True)
            next(stream)
            process.process.kill()
            process.process.wait(timeout=30)
    ended_before = sum(srv.router.pool.replicas.orphans_ended for srv in replicas)
    with Client(replicas[1].grpc_target, api_key=KEY) as client:  # the others serve on
        assert len(client.generate([3, 4], max_tokens=3, ignore_eos=True).token_ids) == 3
    assert until(lambda: sum(srv.router.pool.replicas.orphans_ended for srv in replicas)
                 == ended_before + 1, timeout_s=REGISTRY_TTL_S * 3)
    wait_all_blocks_free(replicas[0])


def test_redis_killed_under_load_fails_nothing_and_is_rebuilt_when_back(replicas, redis):
    """redis-server killed while all three replicas stream: every request completes
    (each replica goes on with its own view); started again empty, the registry is
    rebuilt from the replicas and an abort through another replica works again."""
    rng = random.Random(13)
    prompts = [[rng.randrange(4, 2000) for _ in range(12)] for _ in range(9)]

    async def load(started: asyncio.Event):
        async def one(i, prompt):
            async with AsyncClient(replicas[i % 3].grpc_target, api_key=KEY) as client:
                chunks = client.generate_stream(prompt, max_tokens=120, temperature=0,
                                                ignore_eos=True)
                tokens = list((await chunks.__anext__()).token_ids)
                started.set()
                async for chunk in chunks:
                    tokens += chunk.token_ids
                return tokens
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)],
                                    return_exceptions=True)

    async def kill_under_load():
        started = asyncio.Event()
        running = asyncio.ensure_future(load(started))
        await started.wait()
        await asyncio.to_thread(redis.kill)
        return await running

    outs = asyncio.run(kill_under_load())
    assert [len(o) if isinstance(o, list) else o for o in outs] == [120] * len(prompts)
    redis.start()  # the same port, empty
    spec = replicas[0].router.config.shared

    def rebuilt():
        record, entries = read_registered(spec)
        return record is not None and sorted(e.worker_id for e in entries) == [
            "decode-0", "prefill-0", "prefill-1"]
    assert until(rebuilt, timeout_s=REGISTRY_TTL_S * 2)
    assert until(lambda: all(srv.router.directory.listening.is_set() for srv in replicas),
                 timeout_s=15)

    async def abort_across():
        async with AsyncClient(replicas[2].grpc_target, api_key=KEY) as a, \
                AsyncClient(replicas[0].grpc_target, api_key=KEY) as b:
            chunks = a.generate_stream([3, 4, 5, 6], request_id="after-redis",
                                       max_tokens=450, temperature=0, ignore_eos=True)
            received = [await chunks.__anext__()]
            found = await b.abort("after-redis")
            async for chunk in chunks:
                received.append(chunk)
            return found, received
    found, received = asyncio.run(abort_across())
    assert found and received[-1].finish_reason == "abort"
    wait_all_blocks_free(replicas[0])


def test_pdserve_router_without_a_registered_pool_says_what_to_do(replicas):
    redis_url = replicas[0].router.config.shared.redis_url
    with pdserve_router(redis_url, "--redis-prefix", "nothing-here") as done:
        assert done.process.wait(timeout=60) != 0
        assert done.stderr.ended(10)
    err = "".join(done.stderr.lines)
    assert "no pool is registered under --redis-prefix 'nothing-here'" in err
    assert "Traceback" not in err


def test_an_id_in_flight_on_one_replica_is_refused_by_the_other(replicas, llama_dir):
    first, second = replicas[:2]
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
    """The request runs on the first replica, slowed to outlast the test; the second
    counts it as load on its decode worker (shared_load.py), and its abort ends it."""
    first, second = replicas[:2]
    decode = first.router.workers["decode-0"]
    ray.get(decode.client.actor.__ray_call__.remote(faults.slow_sampler, 0.02))

    async def abort_across():
        async with AsyncClient(first.grpc_target, api_key=KEY) as a, \
                AsyncClient(second.grpc_target, api_key=KEY) as b:
            chunks = a.generate_stream([faults.SLOW, 4, 5, 6], request_id="long",
                                       max_tokens=450, temperature=0, ignore_eos=True)
            received = [await chunks.__anext__()]
            assert await eventually(lambda: second.router.workers["decode-0"].state
                                    .others_inflight == 1)
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


def test_a_prefix_computed_through_one_replica_is_found_through_the_others(replicas):
    """Two prefill workers: turn 1 (96 tokens) is computed through the first replica
    on one of them; every replica's index learns its blocks from that worker's reports,
    so turn 2 through the second and the third goes to the same worker and hits."""
    rng = random.Random(11)
    turn = [rng.randrange(4, 2000) for _ in range(96)]
    with Client(replicas[0].grpc_target, api_key=KEY) as client:
        client.generate(turn, max_tokens=2, temperature=0, ignore_eos=True)
    for srv in replicas[1:]:
        following = turn + [rng.randrange(4, 2000) for _ in range(24)]
        assert until(lambda: srv.router.models.prefixes.hits(block_hashes(following, 16)),
                     timeout_s=30)
        with Client(srv.grpc_target, api_key=KEY) as client:
            out = client.generate(following, max_tokens=2, temperature=0, ignore_eos=True)
        assert out.usage.cached_prompt_tokens == 96  # 6 full blocks, on that worker


def test_a_worker_added_through_one_replica_gets_traffic_from_every_replica(replicas,
                                                                             llama_dir):
    """decode-0 drained through the first replica: every replica sees it draining, and
    the decode worker added through the first's admin API is the only one left to
    decode; requests through each replica are exact on it."""
    first = replicas[0]
    admins = [httpx.Client(base_url=srv.http_url, timeout=120,
                           headers={"Authorization": f"Bearer {ADMIN}"}) for srv in replicas]
    for client in admins:  # the leader would remove a worker above the pool's maximum
        assert client.post("/admin/planner/pause").status_code == 200
    admin = admins[0]
    r = admin.post("/admin/workers", json={"role": "decode", "wait": True})
    assert r.status_code == 201, r.text
    added = r.json()["worker_id"]
    assert added not in ("decode-0", "prefill-0", "prefill-1")
    for srv in replicas:
        assert until(lambda: srv.router.worker_states().get(added) == "serving",
                     timeout_s=10), srv.router.worker_states()
    assert admin.post("/admin/workers/decode-0/drain").status_code == 200
    for srv in replicas:
        assert until(lambda: srv.router.worker_states()["decode-0"] == "draining",
                     timeout_s=10)
    rng = random.Random(12)
    prompts = [[rng.randrange(4, 2000) for _ in range(rng.randrange(8, 40))]
               for _ in range(len(replicas))]
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20, max_model_len=512)
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True))]
    for srv, prompt, want in zip(replicas, prompts, expected):
        with Client(srv.grpc_target, api_key=KEY) as client:
            assert client.generate(prompt, max_tokens=12, temperature=0,
                                   ignore_eos=True).token_ids == want
    # back as it was: decode-0 resumed, the added worker removed through the third
    assert admin.post("/admin/workers/decode-0/resume").status_code == 200
    assert admins[2].delete(f"/admin/workers/{added}").status_code == 200
    for srv in replicas:
        assert until(lambda: added not in srv.router.workers
                     and srv.router.worker_states()["decode-0"] == "serving", timeout_s=10)
    for client in admins:
        assert client.post("/admin/planner/resume").status_code == 200
    wait_all_blocks_free(first)


def test_one_replica_s_planner_leads_and_another_takes_over_when_it_goes(replicas):
    planners = [srv.router.planner for srv in replicas]
    assert until(lambda: sum(p.lease.leading for p in planners) == 1, timeout_s=10)
    leader = next(i for i, p in enumerate(planners) if p.lease.leading)
    others = [p for i, p in enumerate(planners) if i != leader]
    assert not any(p.lease.leading or p.describe()["leading"] for p in others)
    token = planners[leader].lease.token
    srv = replicas[leader]
    srv._run(planners[leader].lease.stop(), timeout=10)  # as when its router ends
    assert until(lambda: sum(p.lease.leading for p in others) == 1, timeout_s=3 * 2.0)
    assert next(p for p in others if p.lease.leading).lease.token > token
