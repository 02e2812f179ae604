"""Prefill and decode workers as real Ray actors, driven the way the router drives
them: reserve on D, prefill on P (KV streamed P -> D), start on D, read D's step
stream. Greedy outputs equal HF transformers; an abort frees every block."""
from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest
import ray

from pdserve import SamplingParams
from pdserve.decode_worker.actor import DecodeWorkerActor
from pdserve.engine.config import EngineConfig
from pdserve.engine.worker_messages import PrefillJob
from pdserve.kv_transfer import TransferConfig
from pdserve.prefill_worker.actor import PrefillWorkerActor
from tests.engine.test_hf_oracle import Oracle

TRANSFER = TransferConfig(timeout_s=30)


class StepReader:
    """Reads a decode worker's StepBatch stream on a thread, per request."""

    def __init__(self, decode):
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, str] = {}
        self._cv = threading.Condition()
        self._stream = decode.steps.remote(30.0)  # stall bound: heartbeats while idle
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ref in self._stream:
                self._take(ray.get(ref))
        except (Exception, SystemExit):  # Ray shutting down at the end of the module
            return

    def _take(self, batch) -> None:
        with self._cv:
            for d in batch.deltas:
                self.tokens[d.request_id] += d.token_ids
                if d.finished:
                    self.finished[d.request_id] = d.finish_reason
            self._cv.notify_all()

    def wait(self, request_ids, timeout=120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not set(request_ids) <= self.finished.keys():
                assert self._cv.wait(deadline - time.monotonic()), "requests did not finish"


@pytest.fixture(scope="module")
def workers(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      long_prefill_token_threshold=32)
    prefill = PrefillWorkerActor.options(num_cpus=1).remote("p0", config, TRANSFER)
    decode = DecodeWorkerActor.options(num_cpus=1).remote("d0", config, TRANSFER)
    reader = StepReader(decode)
    return prefill, decode, reader


def run(prefill, decode, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    now = time.time()
    reservations = ray.get([decode.reserve.remote(rid, p, params, now)
                            for rid, p in prompts.items()])
    assert all(r is not None for r in reservations)
    results = ray.get([prefill.prefill.remote(PrefillJob(rid, p, params, r, now))
                       for (rid, p), r in zip(prompts.items(), reservations)])
    ray.get([decode.start.remote(r.request_id, r.first_token) for r in results])


def test_disaggregated_workers_match_hf(workers, llama_dir):
    prefill, decode, reader = workers
    oracle = Oracle(llama_dir)
    rng = random.Random(11)
    shared = [rng.randrange(4, 2000) for _ in range(32)]
    prompts = {f"w{i}": (shared if i % 2 else []) + [rng.randrange(4, 2000) for _ in range(n)]
               for i, n in enumerate([5, 18, 40, 77, 130, 9])}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    run(prefill, decode, prompts, params)
    reader.wait(prompts)
    for rid, prompt in prompts.items():
        expected, _ = oracle.generate(prompt, 10)
        assert reader.tokens[rid] == expected, f"{rid} ({len(prompt)} prompt tokens) differs"
        assert reader.finished[rid] == "length"


def test_abort_mid_stream_frees_blocks_on_both_workers(workers):
    prefill, decode, reader = workers
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    run(prefill, decode, {"long": list(range(10, 90))}, params)
    deadline = time.monotonic() + 60
    while len(reader.tokens["long"]) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ray.get(decode.abort.remote("long"))
    reader.wait(["long"])
    assert reader.finished["long"] == "abort"
    assert 3 <= len(reader.tokens["long"]) < 500
    for worker in (decode, prefill):
        stats = ray.get(worker.stats.remote())
        assert stats["free_blocks"] == stats["num_blocks"], stats
