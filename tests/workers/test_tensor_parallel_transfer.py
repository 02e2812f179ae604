"""KV handed between tensor-parallel workers of different sizes: each decode rank
receives its KV heads from the prefill ranks that hold them (kv_transfer/heads.py),
through the served Worker's roles, its ranks on threads of this process
(worker/local.py) over real gloo groups and pairs. Greedy outputs equal HF's in
float32 (or differ first at a near-tie: test_hf_oracle's rule)."""
from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kv_transfer import TransferConfig
from pdserve.worker.local import threaded_worker
from pdserve.worker.messages import Job, PrefillJob
from tests.engine.test_hf_oracle import (
    MAX_TOKENS,
    Oracle,
    assert_matches_hf,
    greedy,
    random_prompts,
)

KV_BYTES = 16 << 20
TRANSFER = TransferConfig(timeout_s=60, connect_timeout_s=60)


class Streams:
    """A decode worker's deltas by request, until each finished."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, batch) -> None:
        with self._lock:
            for delta in batch.deltas:
                self.tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finished:
                    self.finished.setdefault(delta.request_id, threading.Event()).set()

    def wait(self, request_id: str, timeout: float) -> list[int]:
        with self._lock:
            event = self.finished.setdefault(request_id, threading.Event())
        assert event.wait(timeout), f"{request_id} did not finish"
        return self.tokens[request_id]


def workers(stack: ExitStack, model_dir, role: str, size: int, name: str, **args):
    config = EngineConfig.from_kwargs(str(model_dir), kv_cache_memory_bytes=KV_BYTES,
                                      tensor_parallel_size=size)
    return stack.enter_context(threaded_worker(name, config, TRANSFER, role, **args))


def disaggregated(prefill, decode, streams: Streams, prompts, tag: str) -> list[list[int]]:
    """Each prompt reserved on `decode`, prefilled on `prefill` (its KV streamed by
    every rank that holds a part of it), then decoded: the tokens as streamed."""
    outputs = []
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        job = Job(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling_params=greedy(n),
                  arrival_time=time.time())
        reservation = decode.reserve(job).result(60)
        assert reservation is not None
        result = prefill.prefill(PrefillJob(job=job, target=reservation)).result(120)
        decode.start(job.request_id, result.first_token).result(60)
        outputs.append(streams.wait(job.request_id, 120))
        assert outputs[-1][0] == result.first_token
    return outputs


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_prefill_and_decode_of_different_tensor_parallel_sizes_equal_hf(model_dirs, name):
    """llama_gqa: 2 KV heads, one per rank at 2 ranks; qwen2_tied: its one KV head on
    every rank (sent once to each decode rank, by one prefill rank). Both ways between
    2 ranks and 1, and 2 to 2; every worker's blocks are free after."""
    model_dir = model_dirs[name]
    oracle = Oracle(model_dir)
    scorer = SimpleNamespace(engine=LLMEngine.from_kwargs(str(model_dir),
                                                          kv_cache_memory_bytes=KV_BYTES))
    prompts = random_prompts(scorer.engine.model_config.vocab_size, seed=5)[:4]
    with ExitStack() as stack:
        one, two = Streams(), Streams()
        p1 = workers(stack, model_dir, "prefill", 1, "p1")
        p2 = workers(stack, model_dir, "prefill", 2, "p2")
        d1 = workers(stack, model_dir, "decode", 1, "d1", on_batch=one)
        d2 = workers(stack, model_dir, "decode", 2, "d2", on_batch=two)
        for prefill, decode, streams, tag in [(p2, d1, one, "a"), (p1, d2, two, "b"),
                                              (p2, d2, two, "c")]:
            outputs = disaggregated(prefill, decode, streams, prompts, tag)
            assert_matches_hf(scorer, oracle, prompts, outputs)
        for worker in (p1, p2, d1, d2):
            blocks = worker.loop.call(lambda e: (e.block_manager.num_free_blocks,
                                                 e.block_manager.num_blocks)).result(30)
            assert blocks[0] == blocks[1], f"{worker.worker_id} holds blocks"
        for worker in (d2,):
            assert all(link.receiver.num_pending == 0 for link in worker.links)
        for worker in (p2,):
            assert all(not link._sends for link in worker.links)


def _clean(worker) -> bool:
    """Every block free, nothing expected or being sent on any rank."""
    free, total = worker.loop.call(lambda e: (e.block_manager.num_free_blocks,
                                              e.block_manager.num_blocks)).result(30)
    return free == total and worker.receiver.num_pending == 0 and all(
        link.receiver.num_pending == 0 and not link._sends for link in worker.links)


def test_cancelled_requests_and_a_decode_worker_leaving_leave_nothing_on_any_rank(llama_dir):
    """P TP 2 -> D TP 2: a reservation cancelled before its prefill (the prefill then
    fails, refused on every rank), a prefill aborted as it starts, and a decode worker
    that leaves: every block is free after, no rank expects or sends anything, and the
    prefill worker's ranks hold no pair with the one that left."""
    from pdserve.kv_transfer import KVTransferError
    from tests.polling import until
    with ExitStack() as stack:
        streams = Streams()
        p2 = workers(stack, llama_dir, "prefill", 2, "p2")
        d2 = workers(stack, llama_dir, "decode", 2, "d2", on_batch=streams)
        prompt = list(range(30, 90))

        def job(rid: str) -> Job:
            return Job(request_id=rid, prompt_token_ids=prompt, sampling_params=greedy(4),
                       arrival_time=time.time())
        early = d2.reserve(job("early")).result(60)
        d2.abort("early")
        with pytest.raises(KVTransferError):
            p2.prefill(PrefillJob(job=job("early"), target=early)).result(60)

        late = d2.reserve(job("late")).result(60)
        pending = p2.prefill(PrefillJob(job=job("late"), target=late))
        p2.abort("late")
        try:
            pending.result(60)
        except Exception:  # noqa: BLE001 - aborted before or after its KV went
            pass
        d2.abort("late")
        assert until(lambda: _clean(p2) and _clean(d2), timeout_s=30)

        assert d2.address in p2.sender.receivers  # paired for the requests above
        p2.disconnect([d2.address])
        ranks_of_d2 = {d2.address, *(link.address(5) for link in d2.links)}
        assert not ranks_of_d2 & set(p2.sender.receivers)
        assert all(not link.sender.receivers for link in p2.links)


def test_swap_and_the_host_tier_in_both_roles_equal_hf(llama_dir):
    """P TP 1 -> D TP 2, both with host memory. Four requests decode at once on a
    decode worker too small for all of them: victims are swapped out and back in.
    Two other prompts then push every block of the first four out of both workers'
    device caches, and the first four come again: the prefill worker loads their
    prefixes from its host tier and transfers them; the decode worker reserves them
    with its own host hits counted as cached (not sent). Every output equals HF's,
    and both workers end with every block free."""
    from tests.engine.test_hf_oracle import host_gib
    oracle = Oracle(llama_dir)
    scorer = SimpleNamespace(engine=LLMEngine.from_kwargs(str(llama_dir),
                                                          kv_cache_memory_bytes=KV_BYTES))
    prompts = random_prompts(scorer.engine.model_config.vocab_size, seed=5)[:4]
    others = [[7 + i] * 60 for i in range(2)]  # 4 blocks each, nothing shared
    tier = host_gib(llama_dir, 256)

    def config(size: int, blocks: int) -> EngineConfig:
        return EngineConfig.from_kwargs(
            str(llama_dir), num_kv_blocks=blocks, tensor_parallel_size=size,
            preemption_mode="swap", swap_space=tier, kv_offloading_size=tier)

    def serve(tag: str, prompts, max_tokens) -> list[list[int]]:
        """Each prompt prefilled in turn (reserved, prefilled, started); then every
        one decodes at once."""
        jobs = [Job(request_id=f"{tag}{i}", prompt_token_ids=prompt,
                    sampling_params=greedy(n), arrival_time=time.time())
                for i, (prompt, n) in enumerate(zip(prompts, max_tokens))]
        for job in jobs:
            reservation = d2.reserve(job).result(60)
            assert reservation is not None
            if tag == "again" and len(job.prompt_token_ids) > 16:  # a full block: a hit
                assert reservation.num_cached_blocks > 0
            result = p1.prefill(PrefillJob(job=job, target=reservation)).result(120)
            d2.start(job.request_id, result.first_token).result(60)
        return [streams.wait(job.request_id, 120) for job in jobs]
    with ExitStack() as stack:
        streams = Streams()
        p1 = stack.enter_context(threaded_worker("p1", config(1, 4), TRANSFER, "prefill"))
        d2 = stack.enter_context(threaded_worker("d2", config(2, 8), TRANSFER, "decode",
                                                 on_batch=streams))
        assert_matches_hf(scorer, oracle, prompts, serve("first", prompts, MAX_TOKENS))
        assert d2.loop.call(lambda e: e.stats.num_swapped_out).result(30) > 0
        for i, prompt in enumerate(others):
            serve(f"other{i}", [prompt], [1])
        assert_matches_hf(scorer, oracle, prompts, serve("again", prompts, MAX_TOKENS))
        for worker in (p1, d2):
            hits = worker.loop.call(lambda e: e.stats.host_prefix_cache_hits).result(30)
            assert hits > 0, f"{worker.worker_id} found no prefix in its host tier"
            assert _clean(worker), f"{worker.worker_id} holds blocks"
