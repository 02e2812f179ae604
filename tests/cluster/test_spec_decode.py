"""Speculative decoding through the cluster: the decode role of a disaggregated one
(1 prefill + 1 decode worker, a draft model whose KV for each prompt the decode worker
computes itself, the target's arriving from the prefill worker) and a colocated one
(prompt lookup, few KV blocks: requests are preempted). Greedy outputs equal HF, stops
inside an accepted run end where plain decoding ends, seeded sampling draws what one
engine draws, every block is free after, and the router exports the acceptance."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.tiny_model import make_draft_model
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.cluster.conftest import stop_cluster, wait_all_blocks_free
from tests.engine.test_hf_oracle import Oracle

CLUSTERS = {
    # 1 prefill + 1 decode, a one-layer draft of the target (acceptances and rejections)
    "disaggregated": (PoolSpec(1, 1), "draft", {}),
    # 2 colocated workers, prompt lookup, 24 blocks of 16 each: preemption under load
    "colocated": (PoolSpec(1, 1, mode="colocated"), "ngram", {"num_kv_blocks": 24}),
}


@pytest.fixture(scope="module", params=list(CLUSTERS))
def cluster(request, ray_local, llama_dir, tmp_path_factory):
    pools, proposer, extra = CLUSTERS[request.param]
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3} if proposer == "ngram" else
            {"method": "draft_model", "num_speculative_tokens": 3,
             "model": str(make_draft_model(llama_dir, tmp_path_factory.mktemp("d") / "d", 1))})
    config = EngineConfig.from_kwargs(str(llama_dir), long_prefill_token_threshold=32,
                                      max_model_len=512, speculative_config=spec,
                                      **({"kv_cache_memory_bytes": 32 << 20} | extra))
    srv = RouterServer(launch(config, pools, TransferConfig(timeout_s=30),
                              served_model_name="test-llama"))
    yield request.param, srv
    stop_cluster(srv)


def _prompts(seed: int) -> list[list[int]]:
    """Phrases repeated (prompt lookup finds them) and random prompts, mixed."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate((6, 33, 70, 140, 21, 90, 48, 110)):
        phrase = [rng.randrange(4, 2000) for _ in range(max(n // 3, 2) if i % 2 else n)]
        out.append((phrase * 3)[:n])
    return out


def _generate(srv, prompts, params: list[dict]):
    with Client(srv.grpc_target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda a: client.generate(a[0], **a[1]), zip(prompts, params)))


def test_greedy_outputs_equal_hf_and_stops_inside_a_run_end_as_plain_decoding(
        cluster, llama_dir):
    name, srv = cluster
    oracle = Oracle(llama_dir)
    prompts = _prompts(51)
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    outs = _generate(srv, prompts, [greedy] * len(prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == oracle.generate(prompt, 24)[0]
    # A stop token and a max_tokens that fall mid-output, as one engine ends them.
    stops = [dict(greedy, stop_token_ids=[out.token_ids[6]]) if i % 2 else
             dict(greedy, max_tokens=7) for i, out in enumerate(outs)]
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20)
    expected = plain.generate(prompts, [SamplingParams(**s) for s in stops])
    for got, want in zip(_generate(srv, prompts, stops), expected):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    wait_all_blocks_free(srv)
    accepted = sum(s.value for m in srv.router.metrics.registry.collect()
                   for s in m.samples if s.name == "pdserve:spec_decode_num_accepted_tokens_total")
    assert accepted > 0


def test_seeded_sampling_draws_what_one_engine_draws(cluster, llama_dir):
    name, srv = cluster
    prompts = _prompts(52)
    # 64 tokens each: the eight requests end holding 67 blocks of 16 (36 of them their
    # prompts'), more than the 2 x 24 the colocated workers have however they are
    # spread, so a worker runs out while its requests grow and preempts one (at 20
    # tokens they ended in 46 blocks: preemption came only when the split was uneven).
    params = [dict(max_tokens=64, temperature=0.5, top_k=5, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    offline = LLM(str(llama_dir), kv_cache_memory_bytes=32 << 20)
    expected = offline.generate(prompts, [SamplingParams(**p) for p in params])
    got = _generate(srv, prompts, params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    if name == "colocated":  # 24 blocks a worker: some requests were preempted
        stats = [w.client.actor.stats.remote() for w in srv.router.workers.values()]
        assert sum(s["num_preemptions"] for s in ray.get(stats)) > 0
    wait_all_blocks_free(srv)
