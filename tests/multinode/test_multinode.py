"""P and D on different Ray nodes: Ray's own test cluster (`ray.cluster_utils.Cluster`,
one raylet per node on this machine), workers pinned to nodes by custom resources.
Greedy outputs equal HF with the KV crossing nodes; a node removed mid-run takes its
worker with it, the router evicts it, and the survivors keep serving."""
from __future__ import annotations

import json
import threading

import pytest
import ray
from ray.cluster_utils import Cluster

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.engine.test_hf_oracle import Oracle

MAX_TOKENS = 8
PROMPTS = [list(range(30 + 5 * i, 60 + 13 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def nodes():
    """A head (no workers) and three nodes: one offers a prefill slot, two a decode
    slot each, so the two decode workers land on different nodes."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    prefill = cluster.add_node(num_cpus=1, resources={"prefill_slot": 1})
    decode = [cluster.add_node(num_cpus=1, resources={"decode_slot": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, prefill, decode
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def server(nodes, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    pools = PoolSpec(1, 2, num_cpus_per_worker=0.5,
                     prefill_resources=json.dumps({"prefill_slot": 1}),
                     decode_resources=json.dumps({"decode_slot": 1}))
    router = launch(config, pools, TransferConfig(timeout_s=30),
                    RouterConfig(revive_timeout_s=3, startup_timeout_s=60),
                    served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    srv.stop()


def node_of(worker) -> str:
    return ray.get(worker.client.actor.__ray_call__.remote(
        lambda actor: ray.get_runtime_context().get_node_id()))


def generate_all(srv: RouterServer) -> list[list[int]]:
    with Client(srv.grpc_target) as client:
        return [client.generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                ignore_eos=True).token_ids for p in PROMPTS]


def test_prefill_and_decode_on_different_nodes_match_hf(nodes, server, llama_dir):
    cluster, prefill_node, decode_nodes = nodes
    workers = server.router.workers
    assert node_of(workers["prefill-0"]) == prefill_node.node_id
    assert {node_of(workers["decode-0"]), node_of(workers["decode-1"])} == \
        {n.node_id for n in decode_nodes}
    oracle = Oracle(llama_dir)
    expected = [oracle.generate(p, MAX_TOKENS)[0] for p in PROMPTS]
    for _ in range(2):  # least-loaded placement sends some to each decode node
        assert generate_all(server) == expected


def test_a_removed_node_s_worker_is_evicted_and_the_survivors_serve(nodes, server,
                                                                   llama_dir):
    cluster, _, decode_nodes = nodes
    router = server.router
    doomed = next(w for w in router.pool.decode.values()
                  if node_of(w) == decode_nodes[1].node_id)
    changed = threading.Condition()

    def notify() -> None:
        with changed:
            changed.notify_all()
    router.on_change.append(notify)
    cluster.remove_node(decode_nodes[1])
    with changed:  # out of service, then (not back within 3 s) evicted
        assert changed.wait_for(lambda: doomed.worker_id not in dict(router.workers), 120)
    oracle = Oracle(llama_dir)
    assert generate_all(server) == [oracle.generate(p, MAX_TOKENS)[0] for p in PROMPTS]
    assert router.ready
