"""The disaggregated path without Ray: a prefill engine streams each request's KV layer
by layer (during its forward pass) to a decode engine in another process, which
continues from the prefill's first token. Greedy outputs equal HF transformers."""
from __future__ import annotations

import multiprocessing as mp
import random

import pytest

from pdserve import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel.messages import StepExport
from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig
from tests.engine.test_hf_oracle import Oracle

KV_BYTES = 32 << 20
MAX_TOKENS = 12


def _decode_main(model_dir: str, conn) -> None:
    engine = LLMEngine.from_kwargs(model_dir, kv_cache_memory_bytes=KV_BYTES)
    receiver = KVReceiver(engine.runner.kv_caches, TransferConfig(timeout_s=30),
                          on_release=engine.abort)
    conn.send(receiver.address)
    bs = engine.block_manager.block_size
    while True:
        command, args = conn.recv()
        if command == "reserve":
            rid, prompt = args
            request = engine.reserve_remote(rid, prompt, greedy())
            cached = request.num_cached_tokens // bs
            receiver.expect(rid, request.block_ids[cached:], cached)
            conn.send((list(request.block_ids), cached))
        elif command == "run":  # {request id: first token} -> {request id: all tokens}
            done = {}
            for rid, first in args[0].items():
                receiver.wait(rid)
                out = engine.admit_remote(rid, first)[0]
                if out.finished:
                    done[rid] = out.token_ids
            while engine.has_unfinished():
                done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            conn.send((done, engine.stats.prefix_cache_hits,
                       engine.block_manager.num_free_blocks == engine.block_manager.num_blocks))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def decode_worker(llama_dir):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_decode_main, args=(str(llama_dir), child), daemon=True)
    process.start()
    assert conn.poll(60)
    address = conn.recv()

    def call(command, *args):
        conn.send((command, args))
        assert conn.poll(120), f"decode worker did not answer {command}"
        return conn.recv()

    yield address, call
    process.kill()
    process.join(10)


def assert_sent(failures: dict) -> None:
    assert not failures, failures


def prefill_and_hand_off(prefill: LLMEngine, sender: KVSender, address: str, call,
                         prompts: dict[str, list[int]]) -> dict[str, int]:
    """Prefill every prompt, streaming KV to the decode worker; returns first tokens."""
    reservations = {rid: call("reserve", rid, prompt) for rid, prompt in prompts.items()}
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, greedy(1))
    handles = []

    def export(out):
        started = []
        for request, n in zip(out.requests, out.num_scheduled):
            if request.num_computed_tokens + n == request.num_tokens:  # prompt completes
                dst, cached = reservations[request.request_id]
                started.append(sender.begin(request.request_id, address, request.block_ids,
                                            dst, cached))
        handles.extend(started)
        if not started:
            return None
        assert not sender.announce(started)
        return StepExport(send=lambda layer: assert_sent(sender.send_layers(started, layer)))

    first = {}
    while prefill.has_unfinished():
        for out in prefill.step(export):
            if out.finished:
                first[out.request_id] = out.token_ids[0]
    for h in handles:
        sender.finish(h)
    return first


def test_prefill_to_decode_handoff_matches_hf(llama_dir, decode_worker):
    address, call = decode_worker
    prefill = LLMEngine.from_kwargs(str(llama_dir), kv_cache_memory_bytes=KV_BYTES,
                                    long_prefill_token_threshold=32, max_num_batched_tokens=96)
    sender = KVSender("prefill-0", prefill.runner.kv_caches, TransferConfig(timeout_s=30))
    oracle = Oracle(llama_dir)
    vocab = prefill.model_config.vocab_size
    rng = random.Random(5)
    shared = [rng.randrange(4, vocab) for _ in range(48)]  # three full blocks
    lengths = [7, 20, 33, 64, 150]  # 150 > the chunk threshold: several prefill steps
    rounds = [{f"r{k}-{i}": shared + [rng.randrange(4, vocab) for _ in range(n)]
               for i, n in enumerate(lengths)} for k in range(2)]
    hits = []
    for prompts in rounds:
        first = prefill_and_hand_off(prefill, sender, address, call, prompts)
        outputs, hit_tokens, all_free = call("run", first)
        hits.append(hit_tokens)
        assert all_free  # every block came back once the requests finished
        for rid, prompt in prompts.items():
            expected, _ = oracle.generate(prompt, MAX_TOKENS)
            assert outputs[rid] == expected, f"{rid} ({len(prompt)} prompt tokens) differs"
    # Round two found the shared prefix in the decode worker's own cache.
    assert hits[1] - hits[0] >= len(lengths) * 48
    sender.close()
