"""Migration by replay on a real cluster (2 prefill + 2 decode workers as Ray actors,
KV over kv_transfer), under load from gRPC, HTTP SSE and non-streaming HTTP clients:
a decode worker SIGKILLed mid-stream, a prefill worker SIGKILLed mid-transfer, a
decode worker SIGSTOPped past the stall bound (then SIGCONTed). Every request
completes, its tokens and text equal to an undisturbed run's (greedy ones equal to HF
transformers, seeded sampled ones drawn the same), and every worker ends with all its
KV blocks free. (--migration-limit 0, today's typed errors: test_worker_faults.py.)"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from pdserve.router.lifecycle import Phase
from tests import faults
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle
from tests.polling import eventually

MAX_TOKENS = 24
# Prompts that start with SLOW decode slowly (faults.slow_sampler): streams outlast
# the moment a test picks to fail a worker under them.
PROMPTS = [[faults.SLOW, *range(20, 20 + n)] for n in (7, 40, 23, 64, 12, 31)]
SEEDED = {1: 11, 4: 12}  # prompt index -> seed: sampled at temperature 1
CLIENTS = ["grpc", "sse", "http", "grpc", "sse", "http"]


@pytest.fixture(scope="module")
def cluster(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router = launch(config, PoolSpec(2, 2), TransferConfig(timeout_s=30),
                    RouterConfig(revive_timeout_s=120, stall_timeout_s=4.0,
                                 telemetry_stale_s=2.0),
                    served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    stop_cluster(srv)


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return Oracle(llama_dir)


def _sampling(i: int) -> dict:
    return ({"temperature": 1.0, "seed": SEEDED[i]} if i in SEEDED else {"temperature": 0})


async def _one(srv: RouterServer, kind: str, i: int) -> tuple[list[int], str, str]:
    """(tokens, text, finish reason) of prompt i, sent as `kind` sends it."""
    prompt, sampling = PROMPTS[i], _sampling(i)
    if kind == "grpc":
        async with AsyncClient(srv.grpc_target, timeout=120) as client:
            out = await client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                        **sampling)
        return out.token_ids, out.text, out.finish_reason
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True, **sampling}
    async with httpx.AsyncClient(base_url=srv.http_url, timeout=120) as http:
        if kind == "http":
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["token_ids"], choice["text"], choice["finish_reason"]
        tokens, text, reason = [], "", None
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                choice = event["choices"][0]
                tokens += choice.get("token_ids") or []
                text += choice["text"]
                reason = choice["finish_reason"] or reason
        return tokens, text, reason


def _load(srv: RouterServer, fault=None) -> list:
    """Every prompt through its client at once; `fault(srv)` (a coroutine) runs
    beside them."""
    async def scenario():
        requests = [_one(srv, kind, i) for i, kind in enumerate(CLIENTS)]
        results = await asyncio.gather(*requests, *([fault(srv)] if fault else []))
        return results[:len(CLIENTS)]
    return asyncio.run(scenario())


def _slow_decoding(srv: RouterServer) -> None:
    for worker in srv.router.pool.decode.values():
        ray.get(worker.client.actor.__ray_call__.remote(faults.slow_sampler, 0.05))


def _pid(worker) -> int:
    return ray.get(worker.client.actor.__ray_call__.remote(faults.pid))


async def _holding(srv: RouterServer, role: str, ready) -> object:
    """The worker of `role` first seen holding a request for which ready(flight)."""
    found = []

    def look():
        for flight in list(srv.router.requests.flights.values()):
            worker = flight.prefill if role == "prefill" else flight.decode
            if worker is not None and worker.state.role == role and ready(flight):
                found.append(worker)
                return True
        return False
    assert await eventually(look, timeout_s=60, every_s=0.01)
    return found[0]


async def _streamed(srv: RouterServer, body: dict) -> dict[int, tuple[list[int], str, str]]:
    """A completion streamed over SSE: each choice's (tokens, text, finish reason)."""
    got: dict[int, tuple[list[int], str, str]] = {}
    body = {**body, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=srv.http_url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    tokens, text, reason = got.get(choice["index"], ([], "", None))
                    got[choice["index"]] = (tokens + choice["token_ids"],
                                            text + choice["text"],
                                            choice["finish_reason"] or reason)
    return got


async def _kill_decode_streaming(srv: RouterServer) -> None:
    """SIGKILLs the decode worker first seen streaming a request 3 tokens in."""
    victim = await _holding(srv, "decode", lambda f: f.phase is Phase.STREAMING
                            and f.num_output_tokens >= 3)
    os.kill(_pid(victim), signal.SIGKILL)


def _moved(srv: RouterServer) -> dict:
    return {(s.labels["reason"], s.labels["phase"]): s.value
            for s in srv.router.metrics.migrations.collect()[0].samples
            if s.name.endswith("_total")}


def _check(srv, oracle, got, undisturbed) -> None:
    assert got == undisturbed  # tokens, text, finish reason: nothing repeated or lost
    for i, (tokens, _, reason) in enumerate(got):
        assert reason == "length" and len(tokens) == MAX_TOKENS
        if i not in SEEDED:
            assert tokens == oracle.generate(PROMPTS[i], MAX_TOKENS)[0]
    assert eventually_serving(srv)  # a killed worker restarted by Ray, and re-paired
    wait_all_blocks_free(srv, timeout_s=60)
    assert srv.router.num_inflight == 0


@pytest.fixture(scope="module")
def undisturbed(cluster):
    _slow_decoding(cluster)
    return _load(cluster)


def test_a_decode_worker_killed_mid_stream_costs_no_request(cluster, oracle, undisturbed):
    before = _moved(cluster)

    got = _load(cluster, _kill_decode_streaming)
    _check(cluster, oracle, got, undisturbed)
    moved = _moved(cluster)
    assert moved.get(("worker_died", "decode"), 0) > before.get(("worker_died", "decode"), 0)
    _slow_decoding(cluster)  # the restarted process decodes at full speed


def test_a_prefill_worker_killed_mid_transfer_costs_no_request(cluster, oracle, undisturbed):
    for worker in cluster.router.pool.prefill.values():
        ray.get(worker.client.actor.__ray_call__.remote(faults.slow_prefill_layers, 0.2))
    before = sum(_moved(cluster).values())

    async def kill_prefill(srv):
        victim = await _holding(srv, "prefill", lambda f: f.phase is Phase.PREFILLING)
        os.kill(_pid(victim), signal.SIGKILL)

    got = _load(cluster, kill_prefill)
    _check(cluster, oracle, got, undisturbed)
    assert sum(_moved(cluster).values()) > before
    for worker in cluster.router.pool.prefill.values():  # the survivor is slow still
        ray.get(worker.client.actor.__ray_call__.remote(faults.slow_prefill_layers, 0.0))


def test_a_decode_worker_stopped_past_the_stall_bound_costs_no_request(cluster, oracle,
                                                                      undisturbed):
    before = _moved(cluster).get(("worker_stalled", "decode"), 0)

    async def stop_decode(srv):
        victim = await _holding(srv, "decode", lambda f: f.phase is Phase.STREAMING
                                and f.num_output_tokens >= 3)
        pid = _pid(victim)
        os.kill(pid, signal.SIGSTOP)
        try:  # its requests move once it made no step within the stall bound
            assert await eventually(lambda: not victim.flights, timeout_s=60)
        finally:
            os.kill(pid, signal.SIGCONT)

    got = _load(cluster, stop_decode)
    _check(cluster, oracle, got, undisturbed)
    assert _moved(cluster).get(("worker_stalled", "decode"), 0) > before


def eventually_serving(srv: RouterServer) -> bool:
    """Every worker back in service (a killed one restarted by Ray and re-paired)."""
    async def check():
        return await eventually(lambda: set(srv.router.worker_states().values())
                                == {"serving"}, timeout_s=120)
    return asyncio.run_coroutine_threadsafe(check(), srv.loop).result(130)


LONG_TOKENS = 160


def _long_load(srv: RouterServer, during) -> tuple[list, object]:
    """Every prompt through gRPC with LONG_TOKENS to make; `during(srv)` beside them."""
    async def one(i):
        async with AsyncClient(srv.grpc_target, timeout=300) as client:
            out = await client.generate(PROMPTS[i], max_tokens=LONG_TOKENS, ignore_eos=True,
                                        **_sampling(i))
        return out.token_ids, out.finish_reason

    async def scenario():
        return await asyncio.gather(asyncio.gather(*[one(i) for i in range(len(PROMPTS))]),
                                    during(srv))
    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def long_expected(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20, max_model_len=512)
    return [llm.generate([p], SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True,
                                             **_sampling(i)))[0].token_ids
            for i, p in enumerate(PROMPTS)]


def test_a_drain_moves_long_requests_live_and_takes_about_their_copy(cluster, oracle,
                                                                   long_expected):
    """Hundreds of tokens left on the drained worker at 50 ms a step: its drain ends
    once their KV moved, each paused for a step or two, and every output is exact."""
    before = _live_moves(cluster)

    async def drain(srv):
        victim = await _holding(srv, "decode", lambda f: f.phase is Phase.STREAMING
                                and f.num_output_tokens >= 5)
        held = len(victim.flights)
        began = time.monotonic()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            srv.router.pool.drain(victim.worker_id), srv.loop))
        drain_s = time.monotonic() - began
        srv.loop.call_soon_threadsafe(srv.router.pool.resume, victim.worker_id)
        return held, drain_s

    got, (held, drain_s) = _long_load(cluster, drain)
    moved = _live_moves(cluster).get("moved", 0) - before.get("moved", 0)
    assert [tokens for tokens, _ in got] == long_expected
    for i, (tokens, _) in enumerate(got):
        if i not in SEEDED:
            assert tokens == oracle.generate(PROMPTS[i], LONG_TOKENS)[0]
    assert held >= 1 and moved >= held
    # what it held had >= 100 tokens (5 s at 50 ms a step) left: waiting would take that
    assert drain_s < 3.0, drain_s
    _check_free(cluster)


def test_a_target_killed_during_a_live_move_costs_no_request(cluster, long_expected):
    """The drained worker's copies are slowed, and the one worker they can go to (the
    other decode worker) is SIGKILLed while they are under way: every request ends
    exact all the same (the moves give up, or fall back to replay, and are tried again
    once it is back), and every block ends free."""
    async def drain_and_kill(srv):
        victim = await _holding(srv, "decode", lambda f: f.phase is Phase.STREAMING
                                and f.num_output_tokens >= 5)
        await victim.client.actor.__ray_call__.remote(faults.slow_moves, 0.5)
        target = next(w for w in srv.router.pool.decode.values() if w is not victim)
        drained = asyncio.run_coroutine_threadsafe(srv.router.pool.drain(victim.worker_id),
                                                   srv.loop)
        assert await eventually(lambda: srv.router.mover.moving, timeout_s=30, every_s=0.01)
        os.kill(_pid(target), signal.SIGKILL)
        await asyncio.wrap_future(drained)
        srv.loop.call_soon_threadsafe(srv.router.pool.resume, victim.worker_id)

    got, _ = _long_load(cluster, drain_and_kill)
    assert [tokens for tokens, _ in got] == long_expected
    _check_free(cluster)


def _live_moves(srv: RouterServer) -> dict:
    return {s.labels["outcome"]: s.value
            for s in srv.router.metrics.live_moves.collect()[0].samples
            if s.name.endswith("_total")}


def _check_free(srv: RouterServer) -> None:
    assert eventually_serving(srv)
    wait_all_blocks_free(srv, timeout_s=60)
    assert srv.router.num_inflight == 0


def test_a_structured_request_whose_decode_worker_is_killed_completes_valid_and_exact(
        cluster, llama_dir):
    """Structured requests streaming (SSE, response_format json_schema; a regex) when
    their decode worker is SIGKILLed: each is replayed (the new workers rebuild its
    grammar state from the tokens it made) and ends valid, equal to HF generate with
    xgrammar's processor, nothing repeated or lost in the stream."""
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.sampling_params import StructuredOutputsParams
    from tests.cluster.test_http import JSON_SCHEMA, SCHEMA
    from tests.engine.test_structured_outputs import XgrammarOracle
    oracle = XgrammarOracle(llama_dir, list(ModelConfig.from_dir(llama_dir).eos_token_ids))
    regex = "[a-z]{4,8} [a-z]{4,8} [0-9]{3}"
    cases = [({"response_format": JSON_SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
             ({"structured_outputs": {"regex": regex}}, StructuredOutputsParams(regex=regex)),
             ({"response_format": JSON_SCHEMA}, StructuredOutputsParams(json=SCHEMA))]
    prompts = [[faults.SLOW, *range(60, 60 + n)] for n in (9, 30, 17)]
    _slow_decoding(cluster)
    before = _moved(cluster).get(("worker_died", "decode"), 0)

    async def one(prompt, extra):
        return (await _streamed(cluster, {"prompt": prompt, "max_tokens": 48,
                                          "temperature": 0, **extra}))[0]

    async def scenario():
        return await asyncio.gather(*(one(p, extra) for p, (extra, _) in zip(prompts, cases)),
                                    _kill_decode_streaming(cluster))
    got = asyncio.run(scenario())[:len(cases)]
    for prompt, (_, constraint), (tokens, text, reason) in zip(prompts, cases, got):
        assert tokens == oracle.generate(prompt, 48, constraint) and reason == "stop"
        if constraint.json:
            assert set(json.loads(text)) == {"ok", "color"}
    assert _moved(cluster).get(("worker_died", "decode"), 0) > before
    assert eventually_serving(cluster)
    wait_all_blocks_free(cluster, timeout_s=60)
    _slow_decoding(cluster)


def test_the_choices_of_a_request_whose_decode_worker_is_killed_each_replay_exact(
        cluster, oracle, llama_dir):
    """n = 3, greedy and seeded, streaming when their decode worker is SIGKILLed: each
    choice moves alone (replayed from its own tokens, its own seed + index) and ends
    equal to an undisturbed run, nothing repeated or lost per choice."""
    prompts = [[faults.SLOW, *range(100, 100 + n)] for n in (19, 33)]
    samplings = [{"temperature": 0}, {"temperature": 1.0, "seed": 31}]
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=16 << 20, max_model_len=512)
    expected = [[o.token_ids for o in llm.generate([p], SamplingParams(
        n=3, max_tokens=MAX_TOKENS, ignore_eos=True, **s))] for p, s in zip(prompts, samplings)]
    assert expected[0] == [oracle.generate(prompts[0], MAX_TOKENS)[0]] * 3
    _slow_decoding(cluster)
    before = _moved(cluster).get(("worker_died", "decode"), 0)

    async def one(prompt, sampling):
        return await _streamed(cluster, {"prompt": prompt, "max_tokens": MAX_TOKENS, "n": 3,
                                         "ignore_eos": True, **sampling})

    async def scenario():
        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, samplings)),
                                    _kill_decode_streaming(cluster))
    got = asyncio.run(scenario())[:2]
    for choices, want in zip(got, expected):
        assert [choices[i][0] for i in range(3)] == want
        assert [choices[i][2] for i in range(3)] == ["length"] * 3
    # every choice of a request on the killed worker moved, each on its own
    assert _moved(cluster).get(("worker_died", "decode"), 0) >= before + 3
    assert eventually_serving(cluster)
    wait_all_blocks_free(cluster, timeout_s=60)
    _slow_decoding(cluster)
