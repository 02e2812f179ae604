"""One local Ray and one disaggregated server (1 prefill + 1 decode worker on the test
Llama) shared by the cluster tests."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch


@pytest.fixture(scope="package")
def ray_local():
    # Logical CPUs: every cluster the package starts fits at once (2 per cluster).
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="package")
def server(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      long_prefill_token_threshold=32, max_model_len=512)
    router = launch(config, PoolSpec(1, 1), TransferConfig(timeout_s=30),
                    served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    stop_cluster(srv)


def stop_cluster(srv: RouterServer) -> None:
    """Stops the front ends and kills the worker actors, so their Ray CPUs are free
    for the next cluster a test starts."""
    srv.stop()
    for worker in srv.router.workers.values():
        worker.client.kill()  # a tensor-parallel worker's placement group goes too


def generate_concurrently(srv: RouterServer, prompts: list[list[int]], max_tokens: int):
    """Greedy completions of all prompts at once through the SDK, one thread each."""
    with Client(srv.grpc_target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True), prompts))


def wait_all_blocks_free(srv: RouterServer, timeout_s: float = 30.0) -> None:
    actors = [w.client.actor for w in srv.router.workers.values()]
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get([a.stats.remote() for a in actors])
        if all(s["free_blocks"] == s["num_blocks"] for s in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


@pytest.fixture(scope="package")
def colocated_server(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      long_prefill_token_threshold=32, max_model_len=512)
    router = launch(config, PoolSpec(1, 1, mode="colocated"), served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    stop_cluster(srv)
