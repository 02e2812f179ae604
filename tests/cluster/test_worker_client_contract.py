"""The WorkerClient seam's contract, held by both of its implementations: the Ray one
(RayWorkerClient over worker actors) and the simulated one (SimWorker running the
same model), each driven through the seam alone, as the router drives it. Same
greedy tokens, before and after a pair is closed; a reservation aborted frees its
blocks, and so do a gone router's requests (another's stay); a call of the wrong
role raises the worker's own error; a role change is refused while the worker holds
a request and taken once it does not; a killed worker's calls raise WorkerDied; a
running request moves live from one decode worker to another (live migration's
calls), its tokens the same as were it never moved."""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.errors import WorkerBusyError, WrongRoleError
from pdserve.kv_transfer import TransferConfig
from pdserve.router.errors import WorkerDied
from pdserve.router.pool.ray_worker_client import RayWorkerClient
from pdserve.sim import virtual_time
from pdserve.sim.tokens import ModelTokens
from pdserve.sim.worker import SimWorker
from pdserve.worker.messages import BlockCopy, IncomingCopy, Job, PrefillJob
from tests import faults
from tests.sim.sims import model_profile

PROMPT = list(range(40, 140))
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
NUM_BLOCKS = 256


def _job(request_id: str, prompt=PROMPT, params=PARAMS) -> Job:
    return Job(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
               arrival_time=time.time())


async def contract(prefill, decode) -> dict:
    """The router's sequence through the seam, and the refusals it relies on."""
    seen: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    free: list[int] = []  # the free blocks each telemetry report said
    arrived = asyncio.Event()  # a batch came

    async def read() -> None:
        async for batch in decode.steps(30.0, "contract"):
            for d in batch.deltas:
                seen.setdefault(d.request_id, []).extend(d.token_ids)
                if d.finished:
                    done[d.request_id] = d.finish_reason
            if batch.telemetry is not None:
                free.append(batch.telemetry.free_blocks)
            arrived.set()
    reader = asyncio.ensure_future(read())

    async def until(condition) -> None:  # on the worker's own reports (idle: every 0.5 s)
        async def wait() -> None:
            while not condition():
                arrived.clear()
                await arrived.wait()
        await asyncio.wait_for(wait(), 30)
    await prefill.connect([await decode.address()])
    total = (await decode.stats()).num_blocks
    reservation = await decode.reserve(_job("r1"), "contract")
    result = await prefill.prefill(PrefillJob(job=_job("r1"), target=reservation))
    await decode.start("r1", result.first_token)
    await until(lambda: "r1" in done)
    await until(lambda: free and free[-1] == total)
    out = {"tokens": [result.first_token] + seen["r1"][1:], "reason": done["r1"]}
    # A pair closed (its receiver left, as far as the sender knows) opens again on use.
    await prefill.disconnect([await decode.address()])
    reservation = await decode.reserve(_job("r2"), "contract")
    result = await prefill.prefill(PrefillJob(job=_job("r2"), target=reservation))
    await decode.start("r2", result.first_token)
    await until(lambda: "r2" in done)
    out["tokens after a disconnect"] = [result.first_token] + seen["r2"][1:]
    with pytest.raises(WrongRoleError):
        await prefill.reserve(_job("wrong"), "contract")
    # A router gone: its requests here end and free their KV; another's stay.
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    orphan = await decode.reserve(_job("orphan", params=long), "gone")
    result = await prefill.prefill(PrefillJob(job=_job("orphan", params=long), target=orphan))
    await decode.start("orphan", result.first_token)
    held = await decode.reserve(_job("held"), "contract")
    out["orphans ended"] = await decode.abort_all("gone")
    free.clear()
    await until(lambda: free and free[-1] == total - len(held.block_ids))
    out["held_blocks"] = len(held.block_ids)
    with pytest.raises(WorkerBusyError):
        await decode.set_role("both")
    await decode.abort("held", "contract")
    free.clear()
    await until(lambda: free and free[-1] == total)
    await decode.set_role("both")
    await decode.set_role("decode")
    decode.kill()
    with pytest.raises(WorkerDied):  # its step stream ends with the death
        await asyncio.wait_for(reader, 30)
    with pytest.raises(WorkerDied):
        await decode.stats()
    return out


MOVED = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


async def live_move_contract(prefill, source, target) -> dict:
    """A running request moved from `source` to `target` through the seam, as
    router/live_move.py moves it: whole blocks copied while it decodes, then paused
    (its marked last delta after its tokens), the rest copied with the tokens made
    since; it decodes on there once that landed (or, where the target cannot resume
    it, it is freed there and its last delta says so, worker_failed).
    Returns its tokens (as the router saw them from both; the source's blocks are all
    free once its copy is aborted), which streams sent a pause marker, the target's
    last delta and whether its blocks are all free at the end."""
    streams = {"s": source, "t": target}
    seen = {name: [] for name in streams}
    finished, marked, free, arrived = set(), [], {}, asyncio.Event()
    last = {}

    async def read(name, worker) -> None:
        async for batch in worker.steps(30.0, "contract"):
            for d in batch.deltas:
                seen[name].extend(d.token_ids)
                marked.extend([name] if d.paused else [])
                finished.update([name] if d.finished else [])
                if d.finished:
                    last[name] = d
            if batch.telemetry is not None:
                free[name] = batch.telemetry.free_blocks
            arrived.set()
    readers = [asyncio.ensure_future(read(n, w)) for n, w in streams.items()]

    async def until(condition) -> None:
        async def wait() -> None:
            while not condition():
                arrived.clear()
                await arrived.wait()
        await asyncio.wait_for(wait(), 30)
    bs, total = 16, (await source.stats()).num_blocks
    await prefill.connect([await source.address()])
    job = _job("m", params=MOVED)
    reservation = await source.reserve(job, "contract")
    result = await prefill.prefill(PrefillJob(job=job, target=reservation))
    await source.start("m", result.first_token)
    await until(lambda: len(seen["s"]) >= 20)
    so_far = [result.first_token] + seen["s"][1:]
    taken = await target.take_over(Job(request_id="m2", prompt_token_ids=PROMPT,
                                       sampling_params=MOVED, arrival_time=time.time(),
                                       output_token_ids=tuple(so_far)), "contract")
    first = taken.num_cached_blocks
    address = await target.address()
    blocks = await target.expect_copy(IncomingCopy(request_id="m2", transfer_id="m2/1",
                                                   first_block=first))
    assert len(blocks) == (len(PROMPT) + len(so_far) - 1) // bs - first  # its whole ones
    await source.send_blocks(BlockCopy(transfer_id="m2/1", request_id="m", first_block=first,
                                       target_address=address, target_blocks=blocks))
    paused = await source.pause("m")
    await until(lambda: "s" in marked)
    outputs = paused.output_token_ids
    assert outputs[:len(so_far)] == so_far and outputs == [result.first_token] + seen["s"][1:]
    first += len(blocks)
    blocks = await target.expect_copy(IncomingCopy(
        request_id="m2", transfer_id="m2/2", first_block=first,
        token_ids=outputs[len(so_far):], text_sent=paused.text_sent, final=True))
    assert first + len(blocks) == -(-paused.num_computed_tokens // bs)
    await source.send_blocks(BlockCopy(transfer_id="m2/2", request_id="m", first_block=first,
                                       target_address=address, target_blocks=blocks,
                                       final=True))  # the target decodes on once it landed
    await source.abort("m", "contract")
    await until(lambda: "t" in finished and free.get("s") == total and free.get("t") == total)
    for reader in readers:
        reader.cancel()
    return {"tokens": outputs + seen["t"], "marked": marked, "last": last["t"]}


@pytest.fixture(scope="module")
def moved(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate(
        [PROMPT], MOVED)[0].token_ids


@pytest.fixture(scope="module")
def expected(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate(
        [PROMPT], PARAMS)[0].token_ids


def test_the_ray_client_holds_the_contract(ray_local, llama_dir, expected):
    from pdserve.worker.actor import WorkerActor

    config = EngineConfig.from_kwargs(str(llama_dir), num_kv_blocks=NUM_BLOCKS,
                                      max_model_len=512)
    transfer = TransferConfig(timeout_s=30)
    actors = [WorkerActor.options(num_cpus=1, max_restarts=0).remote(name, config, transfer,
                                                                     role)
              for name, role in (("cp", "prefill"), ("cd", "decode"))]
    prefill, decode = (RayWorkerClient(a) for a in actors)
    try:
        out = asyncio.run(contract(prefill, decode))
    finally:
        prefill.kill()
        decode.kill()
    assert out["tokens"] == expected and out["reason"] == "length"
    assert out["tokens after a disconnect"] == expected
    assert out["held_blocks"] == -(-len(PROMPT) // 16)
    assert out["orphans ended"] == 1


def test_the_simulated_worker_holds_the_contract(llama_dir, expected):
    async def scenario():
        profile = model_profile(llama_dir, NUM_BLOCKS)
        peers: dict[str, SimWorker] = {}
        prefill, decode = (
            SimWorker(name, role, profile, SchedulerConfig(), peers,
                      tokens=ModelTokens.load(str(llama_dir), NUM_BLOCKS, 16, 512))
            for name, role in (("cp", "prefill"), ("cd", "decode")))
        await asyncio.gather(prefill.boot(), decode.boot())
        return await contract(prefill, decode)
    out = virtual_time.run(scenario())
    assert out["tokens"] == expected and out["reason"] == "length"
    assert out["tokens after a disconnect"] == expected
    assert out["held_blocks"] == -(-len(PROMPT) // 16)
    assert out["orphans ended"] == 1


@pytest.mark.parametrize("resume_fails", [False, True])
def test_the_ray_client_moves_a_running_request_live(ray_local, llama_dir, moved,
                                                     resume_fails):
    from pdserve.worker.actor import WorkerActor

    config = EngineConfig.from_kwargs(str(llama_dir), num_kv_blocks=NUM_BLOCKS,
                                      max_model_len=512)
    transfer = TransferConfig(timeout_s=30)
    actors = [WorkerActor.options(num_cpus=1, max_restarts=0).remote(name, config, transfer,
                                                                     role)
              for name, role in (("lp", "prefill"), ("ls", "decode"), ("lt", "decode"))]
    clients = [RayWorkerClient(a) for a in actors]
    # The source decodes slowly enough (48 steps: 4.8 s) that the request is still
    # running there through the calls of the move: at its own pace (a few ms a step)
    # it could end before the first copy was sent, as it once did in a full run.
    ray.get(actors[1].__ray_call__.remote(faults.slow_sampler, 0.1, PROMPT[0]))
    if resume_fails:
        ray.get(actors[2].__ray_call__.remote(
            lambda actor: faults.failing_resume(faults.actor_scheduler(actor))))
    try:
        out = asyncio.run(live_move_contract(*clients))
    finally:
        for client in clients:
            client.kill()
    _moved_as_told(out, moved, resume_fails)


def _moved_as_told(out: dict, moved: list[int], resume_fails: bool) -> None:
    assert out["marked"] == ["s"]
    if resume_fails:  # freed on the target, the router told to place it again
        assert out["last"].finish_reason == "error" and out["last"].worker_failed
        assert out["tokens"] == moved[:len(out["tokens"])]
    else:
        assert out["tokens"] == moved and out["last"].finish_reason == "length"


@pytest.mark.parametrize("resume_fails", [False, True])
def test_the_simulated_worker_moves_a_running_request_live(llama_dir, moved, resume_fails):
    async def scenario():
        profile = model_profile(llama_dir, NUM_BLOCKS)
        peers: dict[str, SimWorker] = {}
        workers = [SimWorker(name, role, profile, SchedulerConfig(), peers,
                             tokens=ModelTokens.load(str(llama_dir), NUM_BLOCKS, 16, 512))
                   for name, role in (("lp", "prefill"), ("ls", "decode"), ("lt", "decode"))]
        await asyncio.gather(*(w.boot() for w in workers))
        if resume_fails:
            faults.failing_resume(workers[2].scheduler)
        return await live_move_contract(*workers)
    out = virtual_time.run(scenario())
    _moved_as_told(out, moved, resume_fails)
