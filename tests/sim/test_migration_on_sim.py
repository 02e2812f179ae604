"""Migration by replay through the real Router over simulated workers running the
real tiny model, in virtual time: a worker that dies under its requests (decode
mid-stream, prefill mid-transfer, a colocated one) costs them nothing; each is placed
again as its prompt plus the tokens streamed so far, and its stream goes on to the
tokens an undisturbed run gives (greedy, and seeded sampling). Every block on the
surviving workers is free afterwards. --migration-limit 0 keeps today's typed error."""
from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.router.config import PoolSpec, RouterConfig, RoutingSpec
from pdserve.router.errors import WorkerError
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from pdserve.sim.tokens import ModelTokens
from tests.sim.sims import model_profile

PROMPTS = [list(range(100, 140)), list(range(200, 230)), list(range(300, 370)), [5, 6, 7, 8]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=77, ignore_eos=True)


def _cluster(llama_dir, pools: PoolSpec, limit: int = 3) -> SimCluster:
    return SimCluster(model_profile(llama_dir), pools,
                      RouterConfig(routing=RoutingSpec(migration_limit=limit),
                                   revive_timeout_s=5.0),
                      tokens=lambda worker_id: ModelTokens.load(str(llama_dir), 256, 16, 512))


async def _stream(router, prompt, params, request_id, seen: asyncio.Event, after: int):
    """The request's tokens and finish reason; `seen` is set once `after` came."""
    accepted = await router.accept(prompt, params, request_id)
    tokens, reason = [], None
    async for delta in router.generate(accepted):
        tokens += delta.token_ids
        reason = delta.finish_reason
        if len(tokens) >= after:
            seen.set()
    return tokens, reason


def _victim(router, role: str) -> str:
    """The worker of `role` holding the most of this router's requests now."""
    flights = router.requests.flights.values()
    held = [f.prefill if role == "prefill" else f.decode for f in flights]
    ids = [w.worker_id for w in held if w is not None and w.state.role == role]
    return max(set(ids), key=ids.count)


async def _run_and_kill(cluster: SimCluster, params: SamplingParams, role: str,
                        after: int):
    router = await cluster.start()
    seen = asyncio.Event()
    streams = [asyncio.ensure_future(_stream(router, p, params, f"r{i}", seen, after))
               for i, p in enumerate(PROMPTS)]
    await seen.wait()
    victim = _victim(router, role)
    cluster.workers[victim].kill()
    outs = await asyncio.gather(*streams, return_exceptions=True)
    await asyncio.sleep(1.0)
    survivors = [w for w in cluster.workers.values() if w.alive]
    free = all(w.blocks.num_free_blocks == w.blocks.num_blocks and not w.scheduler.requests
               for w in survivors)
    moved = router.metrics.migrations.collect()[0].samples
    await cluster.stop()
    return outs, free, victim, {(s.labels["reason"], s.labels["phase"]): s.value
                                for s in moved if s.name.endswith("_total")}


@pytest.fixture(scope="module")
def undisturbed(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=256, max_model_len=512)
    return {name: [o.token_ids for o in llm.generate(PROMPTS, params)]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_decode_worker_killed_mid_stream_loses_no_request(llama_dir, undisturbed, sampling):
    params = GREEDY if sampling == "greedy" else SEEDED
    cluster = _cluster(llama_dir, PoolSpec(1, 2))
    outs, free, victim, moved = virtual_time.run(_run_and_kill(cluster, params, "decode", 6))
    assert victim.startswith("decode")
    assert [o[0] for o in outs] == undisturbed[sampling]
    assert {o[1] for o in outs} == {"length"}
    assert moved.get(("worker_died", "decode"), 0) >= 1 and free


def test_a_prefill_worker_killed_mid_transfer_loses_no_request(llama_dir, undisturbed):
    cluster = _cluster(llama_dir, PoolSpec(2, 1))
    outs, free, victim, moved = virtual_time.run(_run_and_kill(cluster, GREEDY, "prefill", 0))
    assert victim.startswith("prefill")
    assert [o[0] for o in outs] == undisturbed["greedy"]
    assert moved.get(("worker_died", "prefill"), 0) >= 1
    assert free


def test_a_colocated_worker_killed_mid_stream_loses_no_request(llama_dir, undisturbed):
    cluster = _cluster(llama_dir, PoolSpec(1, 1, mode="colocated"))
    outs, free, victim, moved = virtual_time.run(_run_and_kill(cluster, GREEDY, "both", 4))
    assert [o[0] for o in outs] == undisturbed["greedy"] and free
    assert moved.get(("worker_died", "decode"), 0) >= 1


def test_migration_limit_0_fails_the_dead_worker_s_requests_with_a_typed_error(llama_dir):
    cluster = _cluster(llama_dir, PoolSpec(1, 2), limit=0)
    outs, free, _, moved = virtual_time.run(_run_and_kill(cluster, GREEDY, "decode", 6))
    failed = [o for o in outs if isinstance(o, BaseException)]
    assert failed and all(isinstance(o, WorkerError) for o in failed)
    assert not moved and free


LONG = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)


async def _drain_while_streaming(cluster: SimCluster, params: SamplingParams,
                                 kill_target_at: str = "", fail_resume: bool = False):
    """Streams every prompt; once each has a few tokens, drains the decode worker
    holding the most (and kills the first worker a move copies to in its call
    `kill_target_at`: take_over, before the source pauses; final, as it is told of the
    last copy, after the pause; fail_resume: the first target to resume a moved
    request fails to). Returns the
    streams, the drain's virtual seconds, how many it still held then, whether every
    surviving worker's blocks are free, and the live moves by outcome."""
    router = await cluster.start()
    seen = asyncio.Event()
    streams = [asyncio.ensure_future(_stream(router, p, params, f"r{i}", seen, 8))
               for i, p in enumerate(PROMPTS)]
    await seen.wait()
    await asyncio.sleep(0.05)  # every stream under way
    victim = _victim(router, "decode")
    killed = []
    for worker in cluster.workers.values() if kill_target_at else ():
        # the seam's take_over; the target's part of expect_copy (past the seam's check)
        owner = worker if kill_target_at == "take_over" else worker.moves
        name = "take_over" if kill_target_at == "take_over" else "expect_copy"
        call = getattr(owner, name)

        def dying(first, *args, worker=worker, call=call):
            if not killed and (kill_target_at == "take_over" or first.final):
                killed.append(worker.kill())
            return call(first, *args)
        setattr(owner, name, dying)
    failed_resumes = []
    for worker in cluster.workers.values() if fail_resume else ():
        def failing(request_id, resume=worker.scheduler.resume_moved):
            if not failed_resumes:
                failed_resumes.append(request_id)
                raise ValueError(f"request {request_id} could not resume")
            return resume(request_id)
        worker.scheduler.resume_moved = failing
    loop = asyncio.get_running_loop()
    began = loop.time()
    await router.pool.drain(victim)
    drain_s = loop.time() - began
    held_then = len(router.pool.workers[victim].flights)
    # bounded: a request left parked on a worker would never end
    outs = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 60)
    await asyncio.sleep(1.0)
    survivors = [w for w in cluster.workers.values() if w.alive]
    free = all(w.blocks.num_free_blocks == w.blocks.num_blocks and not w.scheduler.requests
               for w in survivors)
    moves = {s.labels["outcome"]: s.value
             for s in router.metrics.live_moves.collect()[0].samples
             if s.name.endswith("_total")}
    await cluster.stop()
    return outs, drain_s, held_then, free, moves


@pytest.fixture(scope="module")
def undisturbed_long(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=256, max_model_len=512)
    return [o.token_ids for o in llm.generate(PROMPTS, LONG)]


def test_a_drain_moves_running_requests_live_and_ends_long_before_they_would(
        llama_dir, undisturbed_long):
    cluster = _cluster(llama_dir, PoolSpec(1, 3))
    outs, drain_s, held, free, moves = virtual_time.run(_drain_while_streaming(cluster, LONG))
    assert [o[0] for o in outs] == undisturbed_long and free and held == 0
    assert moves.get("moved", 0) >= 1 and not moves.get("replayed")
    # 120 tokens at >= 4 ms a step: a drain that waited would take the rest of them
    assert drain_s < 0.25, drain_s


@pytest.mark.parametrize("at", ["take_over", "final"])
def test_a_target_that_dies_during_a_live_move_costs_no_request(llama_dir, undisturbed_long,
                                                                at):
    """Before the source paused (take_over), the move gives up and is tried again
    elsewhere; after it (final), the request is placed again (replay)."""
    cluster = _cluster(llama_dir, PoolSpec(1, 3))
    outs, _, held, free, moves = virtual_time.run(
        _drain_while_streaming(cluster, LONG, kill_target_at=at))
    assert [o[0] for o in outs] == undisturbed_long and free and held == 0
    assert moves.get("gave_up" if at == "take_over" else "replayed", 0) >= 1


def test_a_moved_request_that_fails_to_resume_on_its_target_is_placed_again(
        llama_dir, undisturbed_long):
    """Its last copy landed, but the target could not take it into its batch: the
    target frees it and says so on its stream, and the router replays it (it used to
    sit parked there, its stream waiting for ever)."""
    cluster = _cluster(llama_dir, PoolSpec(1, 3))
    outs, _, held, free, moves = virtual_time.run(
        _drain_while_streaming(cluster, LONG, fail_resume=True))
    assert [o[0] for o in outs] == undisturbed_long and free and held == 0
    assert moves.get("moved", 0) >= 1


def test_a_copy_into_a_move_aborted_on_its_target_fails_and_writes_nothing():
    """The target expected a copy, then the move was aborted there (its blocks freed,
    maybe reused): the source's late send of that copy fails instead of writing KV
    into them."""
    import time

    from pdserve.engine.config import SchedulerConfig
    from pdserve.engine.errors import MoveError
    from pdserve.sim.worker import SimWorker
    from pdserve.worker.messages import BlockCopy, IncomingCopy, Job, PrefillJob
    from tests.sim.sims import small_profile

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    prompt = list(range(100, 164))  # 4 full blocks

    async def scenario():
        peers: dict = {}
        prefill, source, target = [SimWorker(name, role, small_profile(), SchedulerConfig(),
                                             peers)
                                   for name, role in (("p", "prefill"), ("s", "decode"),
                                                      ("t", "decode"))]
        await asyncio.gather(*(w.boot() for w in (prefill, source, target)))
        await prefill.connect([await source.address()])
        job = Job(request_id="m", prompt_token_ids=prompt, sampling_params=params,
                  arrival_time=time.time())
        reservation = await source.reserve(job, "test")
        result = await prefill.prefill(PrefillJob(job=job, target=reservation))
        await source.start("m", result.first_token)
        await asyncio.sleep(0.5)  # virtual time: it decodes on at the source
        await target.take_over(Job(request_id="m2", prompt_token_ids=prompt,
                                   sampling_params=params, arrival_time=time.time()), "test")
        blocks = await target.expect_copy(IncomingCopy(request_id="m2", transfer_id="m2/1",
                                                       first_block=0))
        await target.abort("m2", "test")
        with pytest.raises(MoveError, match="does not expect"):
            await source.send_blocks(BlockCopy(
                transfer_id="m2/1", request_id="m", first_block=0,
                target_address=await target.address(), target_blocks=blocks))
        return blocks
    assert len(virtual_time.run(scenario())) == 3  # its whole computed blocks (63 tokens)
