"""The other ranks of a tensor-parallel worker: Ray actors in one placement group.

    ranks = start_ranks(config)              # or start_ranks(config, pg): rank 0 is
    engine = LLMEngine(config, ranks.group)  # already in bundle 0 of `pg`
    ...
    engine.close(); ranks.shutdown()

A served worker's ranks also move their own KV heads (worker/rank_kv.py): started
with `kv`, each rank holds a RankKV, and rank 0 reaches it through `Ranks.links`.

A placement group of one bundle per rank (its device, and a CPU), STRICT_PACK: every
rank on rank 0's node (the gloo and NCCL groups are node-local). Without one given,
start_ranks makes one whose bundle 0 is pinned to this process's node and is its own
to remove; on CUDA, rank 0 then computes on the GPU Ray gives bundle 0 (Ranks.device),
so no other rank's bundle shares it. Rank 0 serves a rendezvous store on the node's
address under a random key space, the others join it; the groups are formed before
any weight loads."""
from __future__ import annotations

import logging
import os
import secrets
import time

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.sharding import check_tensor_parallel
from pdserve.kv_transfer import TransferConfig, rendezvous
from pdserve.worker.rank_kv import RankKV, SentKV

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 180.0  # rank actors start, import torch and join the store


def bundle(config: EngineConfig) -> dict[str, float]:
    """What one rank holds: its device, and a CPU to drive it."""
    return {"CPU": 1.0, "GPU": 1.0} if config.device.startswith("cuda") else {"CPU": 1.0}


@ray.remote(concurrency_groups={"kv": 4, "kv_wait": 16})
class RankActor:
    """Rank r > 0: joins the group, loads its shard, computes what rank 0 broadcasts.
    Rank 0's KV calls run beside serve(), on threads of their own: the short ones
    (kv_call: expect, abort, connect) apart from those that wait on transfers
    (kv_wait), so no wait holds up an abort."""

    def __init__(self, config: EngineConfig, rank: int, size: int,
                 kv: tuple[str, TransferConfig] | None = None):
        """kv: (worker id, transfer settings) of a served worker, whose ranks move their
        own KV heads."""
        self.config, self.rank, self.size = config, rank, size
        self.kv = RankKV(kv[0], rank, kv[1], ray.util.get_node_ip_address()) if kv else None

    def serve(self, host: str, port: int, key: str) -> int:
        """Returns the steps it computed once rank 0 says stop; raises if the group
        broke (rank 0 lost, a step failed)."""
        from pdserve.engine.parallel.follower import Follower
        store = rendezvous.scoped(rendezvous.connect(host, port, JOIN_TIMEOUT_S), key)
        group = TensorParallelGroup.join(store, self.rank, self.size,
                                         ray.util.get_node_ip_address(),
                                         torch.device(self.config.device))
        return Follower(self.config, group, self.kv).serve()

    @ray.method(concurrency_group="kv")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="kv")
    def kv_call(self, method: str, *args):
        """One of rank 0's short calls on this rank's KV transfers (RankLink)."""
        if method not in _KV_CALLS:
            raise ValueError(f"no KV call {method!r}")
        return getattr(self.kv, method)(*args)

    @ray.method(concurrency_group="kv_wait")
    def kv_wait(self, method: str, *args):
        """One of rank 0's calls that wait on this rank's transfers (RankLink)."""
        if method not in _KV_WAITS:
            raise ValueError(f"no KV wait {method!r}")
        return getattr(self.kv, method)(*args)


_KV_CALLS = ("address", "connect", "disconnect", "abort_send", "expect", "abort_expected")
_KV_WAITS = ("finished", "send_copies", "wait_landed")


class RankLink:
    """Rank 0's way to a RankActor's KV transfers: each call one actor call, bounded."""

    def __init__(self, actor, transfer: TransferConfig):
        self.actor = actor
        self.timeout_s = transfer.connect_timeout_s  # a call's own bound
        self.transfer_timeout_s = transfer.timeout_s  # and a transfer's

    def _call(self, method: str, *args, timeout_s: float | None = None):
        call = self.actor.kv_wait if method in _KV_WAITS else self.actor.kv_call
        return ray.get(call.remote(method, *args), timeout=timeout_s or self.timeout_s)

    def address(self, timeout_s: float) -> str:
        return self._call("address", timeout_s, timeout_s=timeout_s + self.timeout_s)

    def connect(self, addresses: list[str]) -> None:
        self._call("connect", addresses)

    def disconnect(self, addresses: list[str]) -> None:
        self._call("disconnect", addresses)

    def finished(self, request_id: str, timeout_s: float) -> SentKV:
        return self._call("finished", request_id, timeout_s,
                          timeout_s=timeout_s + self.timeout_s)

    def abort_send(self, request_id: str) -> None:
        self._call("abort_send", request_id)

    def send_copies(self, copies: tuple) -> dict[str, SentKV]:
        return self._call("send_copies", copies,
                          timeout_s=self.timeout_s + self.transfer_timeout_s)

    def expect(self, request_id: str, block_ids: list[int], num_cached_blocks: int,
               watched: bool = False) -> None:
        self._call("expect", request_id, block_ids, num_cached_blocks, watched)

    def wait_landed(self, request_id: str, timeout_s: float) -> SentKV:
        return self._call("wait_landed", request_id, timeout_s,
                          timeout_s=timeout_s + self.timeout_s)

    def abort_expected(self, request_id: str) -> None:
        self._call("abort_expected", request_id)


class Ranks:
    """Ranks 1..N-1 of the worker whose rank 0 is this process, and its group."""

    def __init__(self, group: TensorParallelGroup, store, actors: list, serving: list,
                 placement: PlacementGroup, owns_placement: bool, device: str,
                 links: list | None = None):
        self.group = group
        self.links = links or []  # RankLinks, rank 1 first (started with kv)
        self.pids: list[int] = []  # the rank actors' processes, rank 1 first
        self.device = device  # rank 0's: on CUDA, the GPU its bundle holds
        self.store = store  # the group's rendezvous: it lives as long as the group
        self.actors = actors
        self._serving = serving  # each actor's serve() call
        self.placement = placement
        self._owns_placement = owns_placement

    def lost(self, timeout_s: float = 0) -> list[int]:
        """The ranks whose serve() ended (any ending before shutdown is a failure),
        waiting up to timeout_s (None: until one does) for the first."""
        serving = list(self._serving)
        if not serving:
            return []
        done, _ = ray.wait(serving, num_returns=1, timeout=timeout_s)
        if done:
            done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
        return [1 + serving.index(ref) for ref in done]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """After the engine's close() (which tells the ranks to stop): waits for them
        a bounded time, then kills them, and removes the placement group it made."""
        self.group.close()  # already closed by the engine's close, unless it failed
        if self._serving:
            ray.wait(self._serving, num_returns=len(self._serving), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._serving = [], []
        if self._owns_placement:
            remove_placement_group(self.placement)
            self._owns_placement = False


def start_ranks(config: EngineConfig, placement: PlacementGroup | None = None,
                timeout_s: float = JOIN_TIMEOUT_S,
                kv: tuple[str, TransferConfig] | None = None,
                resources: dict[str, float] | None = None) -> Ranks:
    """Ranks 1..N-1 started in `placement` (bundles 1..N-1; this process is rank 0,
    in bundle 0) or in a placement group made here; returns once all joined. kv:
    (worker id, transfer settings) of a served worker (Ranks.links); resources: what
    each rank actor holds of its bundle (num_cpus, num_gpus; default `bundle`'s)."""
    size = config.tensor_parallel_size
    check_tensor_parallel(ModelConfig.from_dir(resolve_model_path(config.model)), size)
    host = ray.util.get_node_ip_address()
    owns = placement is None
    if owns:
        bundles = [bundle(config) for _ in range(size)]
        bundles[0][f"node:{host}"] = 0.001  # rank 0 is here: the group is too
        placement = placement_group(bundles, strategy="STRICT_PACK",
                                    name=f"pdserve-tp-{secrets.token_hex(4)}")
    actors: list = []
    try:
        ready, _ = ray.wait([placement.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"tensor_parallel_size {size}: no node could place {size} "
                               f"bundles of {bundle(config)} within {timeout_s:g}s")
        device = config.device
        if owns and device.startswith("cuda"):  # this process is bundle 0's: its GPU
            gpu = ray.get(_bundle_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=0), num_cpus=0, num_gpus=1).remote(),
                timeout=timeout_s)
            device = f"cuda:{_local_index(gpu)}"
        key = secrets.token_hex(16)
        store = rendezvous.serve(host, timeout_s)
        began = time.monotonic()
        for rank in range(1, size):
            actors.append(RankActor.options(
                **(resources or _resources(config)),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=rank)).remote(
                        config, rank, size, kv))
        serving = [a.serve.remote(host, store.port, key) for a in actors]
        group = TensorParallelGroup.join(rendezvous.scoped(store, key), 0, size, host,
                                         torch.device(device))
        log.info("tensor-parallel group of %d joined in %.1fs", size, time.monotonic() - began)
        links = [RankLink(actor, kv[1]) for actor in actors] if kv else []
        ranks = Ranks(group, store, actors, serving, placement, owns, device, links)
        ranks.pids = ray.get([a.pid.remote() for a in actors], timeout=timeout_s)
        return ranks
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if owns:
            remove_placement_group(placement)
        raise


@ray.remote
def _bundle_gpu() -> int:
    """The GPU Ray gives a bundle (run in it): where rank 0 computes, so that no other
    rank's bundle shares it."""
    return int(ray.get_gpu_ids()[0])


def _local_index(gpu: int) -> int:
    """A node GPU id as this process numbers its devices (CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return gpu
    ids = [v.strip() for v in visible.split(",")]
    if str(gpu) not in ids:
        raise RuntimeError(f"rank 0's GPU {gpu} is not among this process's "
                           f"CUDA_VISIBLE_DEVICES={visible}")
    return ids.index(str(gpu))


def _resources(config: EngineConfig) -> dict:
    each = bundle(config)
    return {"num_cpus": each["CPU"], "num_gpus": each.get("GPU", 0)}
