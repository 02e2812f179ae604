"""A decode worker in-process, fed by a real KVSender over gloo: many starts that
arrive together join the batch at one step boundary."""
from __future__ import annotations

import threading
import time

import torch

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import KVSender, TransferConfig
from pdserve.worker.messages import Job
from pdserve.worker.worker import Worker


def test_starts_arriving_together_join_at_one_step_boundary(llama_dir):
    batches = []
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=8 << 20)
    worker = Worker("d", config, TransferConfig(timeout_s=30), "decode", on_batch=batches.append)
    sender = KVSender("p", [torch.randn_like(c) for c in worker.loop.engine.runner.kv_caches],
                      TransferConfig(timeout_s=30))
    gate = threading.Event()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        n = 12  # more than any fixed pool of waiting threads
        reservations = [worker.reserve(Job(
            request_id=f"r{i}", prompt_token_ids=list(range(10 + i, 30 + i)),
            sampling_params=params, arrival_time=time.time())).result(30)
                        for i in range(n)]
        for r in reservations:  # each prompt's KV lands before its start
            handle = sender.begin(r.request_id, r.receiver_address, r.block_ids, r.block_ids)
            for layer in range(sender.layout.num_layers):
                sender.send_layer(handle, layer)
            sender.finish(handle)
        # Hold the engine thread between steps while every start arrives.
        worker.loop.call(lambda engine: gate.wait(30))
        started = [worker.start(r.request_id, 7) for r in reservations]
        gate.set()
        for future in started:
            future.result(30)
        deadline = time.monotonic() + 30
        while not any(b.deltas[0].num_output_tokens == 2 for b in batches):
            assert time.monotonic() < deadline, "no decode step followed"
            time.sleep(0.01)
        joins = [b for b in batches if b.deltas[0].num_output_tokens == 1]
        first_step = next(b for b in batches if b.deltas[0].num_output_tokens == 2)
        assert len(joins) == n
        assert batches.index(first_step) == n  # every join came before the first step
        assert sorted(d.request_id for d in first_step.deltas) == sorted(f"r{i}" for i in range(n))
    finally:
        gate.set()
        worker.shutdown()
        sender.close()
