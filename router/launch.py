"""Start the workers as Ray actors and build a Router over them (`launch`), or build
another router replica over a pool registered in Redis (`join`). The same
WorkerSpawner starts workers at run time (Pool.add, the replacement of an evicted
worker). The router reaches each actor through a RayWorkerClient.

A pool shared by several replicas (`--redis-url`) has named, detached actors: any
replica finds them by name, and they outlive the replica that started them; the
last replica to stop ends them."""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import defaultdict
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.config import EngineConfig
from pdserve.engine.host_kv_cache import check_host_memory
from pdserve.engine.kv_cache import bytes_per_block
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.model_runner import DTYPES
from pdserve.engine.parallel.sharding import check_tensor_parallel
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import (
    PoolSpec,
    RouterConfig,
    SharedStateSpec,
)
from pdserve.router.model_info import ModelInfo
from pdserve.router.pool.placement import (
    PlacementError,
    fmt_resources,
    unplaceable,
    until_placeable,
)
from pdserve.router.pool.ray_worker_client import RayWorkerClient
from pdserve.router.pool.spawner import Progress
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.pool_registry import (
    LocalRegistry,
    PoolRecord,
    PoolRegistry,
    RegistryError,
    WorkerEntry,
    registry_for,
)
from pdserve.router.router import Router
from pdserve.worker.actor import WorkerActor

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"  # the Ray namespace of shared pools' named actors
ORPHAN_TTLS = 3  # registry TTLs a shared pool's worker waits for a router, then ends


@dataclass(frozen=True)
class SharedActors:
    """How the actors of a pool shared by router replicas are named: in one Ray
    namespace, by the pool's id (a crashed earlier pool's leftovers never collide)."""
    pool_id: str
    namespace: str = NAMESPACE

    def name(self, worker_id: str) -> str:
        return f"pdserve-{self.pool_id}-{worker_id}"


class WorkerSpawner:
    """Creates worker actors of a role with the pool's resources, placement and
    restart policy. Worker ids are `<role it started in>-<n>`, never reused (numbered
    by the registry when replicas share the pool).

    A worker of tensor_parallel_size N > 1 (per role: PoolSpec) gets a placement group
    of its own: N bundles alike (a device each, where the pool's workers hold GPUs),
    STRICT_PACK on one node, the worker actor (rank 0) in bundle 0 and its other
    ranks in the rest (worker/ranks.py). The group goes when the worker is killed;
    it fate-shares with whoever made it (detached for a shared pool's workers)."""

    def __init__(self, engine_config: EngineConfig, pools: PoolSpec,
                 transfer: TransferConfig, router_config: RouterConfig,
                 shared: SharedActors | None = None,
                 registry: PoolRegistry = LocalRegistry()):
        self.engine_config, self.pools = engine_config, pools
        self.transfer, self.router_config = transfer, router_config
        self.shared, self.registry = shared, registry
        self._numbers: defaultdict[str, itertools.count] = defaultdict(itertools.count)
        self._requested: list[dict[str, float]] | None = None  # the last autoscaler request
        self.placements: dict[str, object] = {}  # worker id -> its placement group, or None

    def wanted(self, workers: dict[str, int]) -> None:
        """Asks Ray's autoscaler (request_resources) for room for every worker of the
        pool, those being placed included, so a `ray up` or KubeRay cluster adds the
        node a new worker waits for and lets go of one a removed worker left idle. The
        request is the whole pool's, not an increment: Ray counts the resources in use
        toward it. Without an autoscaler it is a note in Ray's state, and harmless."""
        bundles = [self.demand(role) for role, n in sorted(workers.items())
                   for _ in range(n)]
        if bundles == self._requested:
            return
        self._requested = bundles
        asyncio.get_running_loop().run_in_executor(None, _request_resources, bundles)

    def demand(self, role: str) -> dict[str, float]:
        """What one worker of `role` needs of one node: every rank's bundle."""
        pools = self.pools
        size = self.tensor_parallel_size(role)
        fixed = {k: v * size for k, v in (("CPU", pools.num_cpus_per_worker),
                                          ("GPU", pools.num_gpus_per_worker)) if v}
        return {**fixed, **pools.resources(role)}

    def tensor_parallel_size(self, role: str) -> int:
        return self.pools.tensor_parallel_size(role, self.engine_config.tensor_parallel_size)

    def _bundles(self, role: str) -> list[dict[str, float]]:
        """A worker's ranks' bundles: each one's CPUs and device; the role's custom
        resources in bundle 0, where the worker actor is."""
        pools = self.pools
        each = {k: v for k, v in (("CPU", pools.num_cpus_per_worker),
                                  ("GPU", pools.num_gpus_per_worker)) if v} or {"CPU": 0.001}
        bundles = [dict(each) for _ in range(self.tensor_parallel_size(role))]
        bundles[0].update(pools.resources(role))
        return bundles

    def create(self, role: str, number: int | None = None) -> tuple[str, object]:
        """A new actor (loading in the background) and its id."""
        number = next(self._numbers[role]) if number is None else number
        worker_id = f"{role}-{number}"
        pools = self.pools
        options = {"num_cpus": pools.num_cpus_per_worker,
                   "num_gpus": pools.num_gpus_per_worker,
                   "resources": pools.resources(role) or None,
                   "max_restarts": pools.max_restarts,
                   # Workers share cores with each other and the router: OpenMP
                   # threads that spin-wait after every parallel region would steal
                   # them (measured: the gRPC path's throughput 0.75 -> 0.87 of
                   # in-process with passive waiting).
                   "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
        size = self.tensor_parallel_size(role)
        config = replace(self.engine_config, tensor_parallel_size=size)
        placement = None
        if size > 1:
            placement = placement_group(
                self._bundles(role), strategy="STRICT_PACK",
                name=ranks_placement_name(self.shared.name(worker_id)) if self.shared
                else f"pdserve-tp-{worker_id}-{secrets.token_hex(3)}",
                lifetime="detached" if self.shared is not None else None)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=0)
        elif pools.placement == "spread":
            options["scheduling_strategy"] = "SPREAD"
        if self.shared is not None:
            options.update(name=self.shared.name(worker_id), namespace=self.shared.namespace,
                           lifetime="detached")
        # A shared pool's detached workers end themselves once no router has listened
        # for a few registry TTLs (every replica gone): nothing else would end them.
        orphan_after_s = 0.0 if self.shared is None else \
            ORPHAN_TTLS * self.router_config.shared.registry_ttl_s
        actor = WorkerActor.options(**options).remote(
            worker_id, config, self.transfer, role, orphan_after_s,
            rank_resources={"num_cpus": options["num_cpus"], "num_gpus": options["num_gpus"]})
        self.placements[worker_id] = placement
        return worker_id, actor

    async def __call__(self, role: str, progress: Progress = lambda worker_id, state: None
                       ) -> WorkerHandle:
        """A loaded worker of `role`, not yet paired or subscribed (Pool.join does
        that). progress(worker_id, state) hears "pending" once the actor exists and
        "starting" once Ray placed it. Raises PlacementError at once if no node could
        ever hold it (the check launch makes, against each node's whole capacity),
        and, the actor ended, if Ray does not place it within placement_timeout_s or
        it does not load within startup_timeout_s after that."""
        nodes = await asyncio.to_thread(ray.nodes)
        problem = unplaceable({f"a new {role} worker": self.demand(role)},
                              [n["Resources"] for n in nodes if n["Alive"]])
        if problem is not None:
            raise PlacementError(problem)
        number = await self.registry.next_worker_number()
        if number is None and self.shared is not None:  # Redis unreachable: still unique
            number = int.from_bytes(secrets.token_bytes(3), "big") + 1_000_000
        worker_id, actor = self.create(role, number)
        config = self.router_config
        try:
            progress(worker_id, "pending")
            await self._until_placed(worker_id, actor, role)
            progress(worker_id, "starting")
            stats = await asyncio.wait_for(actor.stats.remote(), config.startup_timeout_s)
        except asyncio.TimeoutError:
            self.kill(worker_id, actor)
            raise PlacementError(f"worker {worker_id} was placed but did not load within "
                                 f"{config.startup_timeout_s:g}s") from None
        except BaseException:  # abandoned, cancelled (shutdown), or it died loading
            self.kill(worker_id, actor)
            raise
        return WorkerHandle.of(worker_id, RayWorkerClient(actor, self.placements.pop(worker_id)),
                               role,
                               num_blocks=stats["num_blocks"], locator=self.locator(worker_id),
                               generation=stats["incarnation"])

    def kill(self, worker_id: str, actor) -> None:
        """A worker that never joined: its actor, and its placement group if it has
        one (and its ranks with it)."""
        RayWorkerClient(actor, self.placements.pop(worker_id, None)).kill()

    def locator(self, worker_id: str) -> str:
        return "" if self.shared is None else self.shared.name(worker_id)

    async def attach(self, locator: str) -> RayWorkerClient:
        """The actor another replica started, found by name."""
        if self.shared is None:
            raise RuntimeError("this pool is not shared: its workers have no names")
        actor = await asyncio.to_thread(ray.get_actor, locator, self.shared.namespace)
        return RayWorkerClient(actor, await asyncio.to_thread(placement_of, actor))

    async def _until_placed(self, worker_id: str, actor, role: str) -> None:
        """Returns once Ray started the actor's process; PlacementError after
        placement_timeout_s. Ray sends no event when it places an actor: its entry
        in Ray's actor table is read every half second."""
        loop = asyncio.get_running_loop()
        timeout_s = self.router_config.placement_timeout_s
        deadline = loop.time() + timeout_s
        while not await asyncio.to_thread(placed, actor):
            if loop.time() > deadline:
                free = await asyncio.to_thread(ray.available_resources)
                demand = self.demand(role)
                raise PlacementError(
                    f"Ray did not place worker {worker_id} within {timeout_s:g}s: it needs "
                    f"{fmt_resources(demand)} on one node, and the cluster has "
                    f"{fmt_resources({k: free.get(k, 0.0) for k in demand})} free in all")
            await asyncio.sleep(0.5)


def check_tensor_parallel_sizes(model: ModelConfig, engine_config: EngineConfig,
                                pools: PoolSpec, router_config: RouterConfig) -> None:
    """Each pool's tensor_parallel_size splits the model, the pools of a mode whose
    workers take every role have one size, and the planner's device budget holds its
    minima; or ValueError naming the flag."""
    sizes = {role: pools.tensor_parallel_size(role, engine_config.tensor_parallel_size)
             for role in ("prefill", "decode")}
    if pools.mode == "adaptive" and sizes["prefill"] != sizes["decode"]:
        raise ValueError("--mode adaptive: every worker takes every role, so "
                         "--prefill-tensor-parallel-size and --decode-tensor-parallel-size "
                         f"must be equal (here {sizes['prefill']} and {sizes['decode']})")
    spec = router_config.autoscale
    if spec.autoscale:
        roles = ("prefill", "decode") if pools.mode == "disaggregated" else ("both",)
        try:
            spec.planner_config(roles, {r: sizes["prefill" if r == "prefill" else "decode"]
                                        for r in roles})
        except ValueError as err:
            raise ValueError(f"--max-devices {spec.max_devices}: {err}") from None
    for role, flag in (("prefill", "prefill_tensor_parallel_size"),
                       ("decode", "decode_tensor_parallel_size")):
        if role == "prefill" and pools.mode != "disaggregated":
            continue
        size = pools.tensor_parallel_size(role, engine_config.tensor_parallel_size)
        try:
            check_tensor_parallel(model, size)
        except ValueError as err:
            named = flag if getattr(pools, flag) else "tensor_parallel_size"
            raise ValueError(f"--{named.replace('_', '-')}: {err}") from None


def ranks_placement_name(locator: str) -> str:
    """The placement group of a shared pool's tensor-parallel worker, by its name."""
    return f"{locator}-ranks"


def placement_of(actor, timeout_s: float = 10.0):
    """The placement group a worker another router started was placed in (named groups
    are scoped to their creator's namespace: the worker says which by id), or None."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    try:
        found = ray.get(actor.placement_group_id.remote(), timeout=timeout_s)
    except Exception as exc:  # gone, or restarting: its group is the pool's to find
        log.warning("could not ask a worker for its placement group: %r", exc)
        return None
    return PlacementGroup(PlacementGroupID(bytes.fromhex(found))) if found else None


def _request_resources(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources
    try:
        request_resources(bundles=bundles)
    except Exception as exc:  # a hint to the autoscaler: never worth failing for
        log.warning("could not ask Ray's autoscaler for %d worker bundles: %s",
                    len(bundles), exc)


def placed(actor) -> bool:
    """Whether Ray has started the actor's process (its actor-table entry names one).
    Read through Ray's private state API, the one that needs no dashboard; a Ray that
    cannot say counts as placed, so an unknown answer never abandons a worker (its
    load is still bounded)."""
    try:
        from ray._private import state
        return bool(state.actors(actor_id=actor._actor_id.hex()).get("Pid"))
    except Exception:
        return True


def launch(engine_config: EngineConfig, pools: PoolSpec = PoolSpec(),
           transfer: TransferConfig = TransferConfig(),
           router_config: RouterConfig = RouterConfig(),
           served_model_name: str | None = None, wait_for_nodes_s: float = 0.0) -> Router:
    """Blocking: actors are up, paired and have reported their KV capacity when it
    returns. Call Router.start() on the event loop that will serve it.
    `wait_for_nodes_s`: how long nodes that could hold the workers may take to join
    (a cluster being brought up, or scaled by Ray's autoscaler, which is asked for
    them); 0: the nodes there now must hold them."""
    served = served_model_name or engine_config.model
    # One secret per cluster keys its KV rendezvous (kv_transfer/rendezvous.py).
    transfer = replace(transfer, secret=transfer.secret or secrets.token_hex(16))
    model_dir = resolve_model_path(engine_config.model)  # build `tiny` once, here
    engine_config = replace(engine_config, model=str(model_dir))
    check_tensor_parallel_sizes(ModelConfig.from_dir(model_dir), engine_config, pools,
                                router_config)
    # Host KV memory, against this host (each worker checks its own as it starts).
    check_host_memory(engine_config.cache.swap_space, engine_config.cache.kv_offloading_size,
                      max(pools.tensor_parallel_size(role, engine_config.tensor_parallel_size)
                          for role in ("prefill", "decode")))
    router_id = new_router_id()
    registry = registry_for(router_config.shared, router_id)
    shared = None
    if registry.shared:
        _check_unregistered(router_config.shared)  # before any worker loads
        shared = SharedActors(pool_id=secrets.token_hex(4))
    spawner = WorkerSpawner(engine_config, pools, transfer, router_config, shared, registry)
    roles = pools.roles
    demands = {f"{role}-{i}": spawner.demand(role) for i, role in enumerate(roles)}

    def nodes() -> list[dict[str, float]]:
        return [n["Resources"] for n in ray.nodes() if n["Alive"]]

    problem = unplaceable(demands, nodes())
    if problem is not None and wait_for_nodes_s > 0:
        log.warning("waiting up to %gs for nodes to join: %s", wait_for_nodes_s, problem)
        _request_resources(list(demands.values()))
        problem = until_placeable(demands, nodes, timeout_s=wait_for_nodes_s)
        if problem is not None:
            _request_resources([])  # no node is wanted for a router that gives up
    if problem is not None:
        raise PlacementError(problem)
    created = [spawner.create(role) for role in roles]
    try:
        stats = _get([actor.stats.remote() for _, actor in created], router_config, "start")
        decoders = [(worker_id, actor) for (worker_id, actor), role in zip(created, roles)
                    if role != "prefill"]
        addresses = dict(zip((worker_id for worker_id, _ in decoders), _get(
            [actor.address.remote() for _, actor in decoders], router_config, "start")))
    except BaseException:  # detached actors (a shared pool) outlive this process
        for worker_id, actor in created:
            spawner.kill(worker_id, actor)
        raise
    workers = [WorkerHandle.of(worker_id, RayWorkerClient(
        actor, spawner.placements.pop(worker_id, None)), role,
                               num_blocks=s["num_blocks"], address=addresses.get(worker_id, ""),
                               locator=spawner.locator(worker_id), generation=s["incarnation"])
               for (worker_id, actor), role, s in zip(created, roles, stats)]
    # every pair, before traffic
    adaptive = pools.mode == "adaptive"
    _get([w.client.actor.connect.remote([a for d, a in addresses.items() if d != w.worker_id])
          for w in workers if w.state.sends_kv(adaptive)], router_config, "pair up")
    model = ModelConfig.from_dir(model_dir)
    max_len = min(engine_config.max_model_len or model.max_position_embeddings,
                  model.max_position_embeddings)
    block_size = engine_config.cache.block_size
    info = ModelInfo(name=served, max_model_len=max_len, vocab_size=model.vocab_size,
                     block_size=block_size, kv_bytes_per_block=bytes_per_block(
                         model, block_size, DTYPES[engine_config.resolved_dtype]))
    record = None if shared is None else PoolRecord.of(
        pool_id=shared.pool_id, ray_address=ray.get_runtime_context().gcs_address,
        namespace=shared.namespace, model=info, adaptive=adaptive, engine=engine_config,
        pools=pools, transfer=transfer)
    return Router(Tokenizer(model_dir), info, workers,
                  replace(router_config, adaptive=adaptive), spawner, router_id=router_id,
                  registry=registry, record=record)


def join(record: PoolRecord, entries: list[WorkerEntry], router_config: RouterConfig,
         model_dir: str | None = None) -> Router:
    """Another router replica over a registered pool (`pdserve router`), on the Ray
    cluster the pool is on (ray.init first). Blocking: it reaches every worker the
    registry names (one that cannot be found is left out, and logged). model_dir: where
    the model is on this machine (default: where the pool's record says)."""
    shared = SharedActors(pool_id=record.pool_id, namespace=record.namespace)
    router_id = new_router_id()
    registry = registry_for(router_config.shared, router_id)
    router_config = replace(router_config, adaptive=record.adaptive)
    spawner = WorkerSpawner(record.engine_config(), record.pool_spec(),
                            record.transfer_config(), router_config, shared, registry)
    workers = []
    for entry in entries:
        try:
            actor = ray.get_actor(entry.locator, namespace=shared.namespace)
        except ValueError:
            log.error("worker %s of the registry is gone; left out", entry.worker_id)
            continue
        worker = WorkerHandle.of(entry.worker_id, RayWorkerClient(actor, placement_of(actor)),
                                 entry.role,
                                 num_blocks=entry.num_blocks, address=entry.address,
                                 locator=entry.locator, generation=entry.generation)
        worker.update(draining=entry.draining)
        workers.append(worker)
    return Router(Tokenizer(model_dir or record.model_dir), record.model, workers,
                  router_config, spawner, router_id=router_id, registry=registry)


def new_router_id() -> str:
    return f"router-{secrets.token_hex(6)}"


def _check_unregistered(spec: SharedStateSpec) -> None:
    """RegistryError when a live pool is registered under spec's prefix already."""
    from pdserve.router.replicas.redis_registry import read_registered

    record, _ = read_registered(spec)
    if record is not None:
        raise RegistryError(f"a pool is registered under --redis-prefix "
                            f"{spec.redis_prefix!r} already: start another router over it "
                            f"with `pdserve router`, or choose another prefix")


def _get(refs: list, config: RouterConfig, what: str) -> list:
    try:
        return ray.get(refs, timeout=config.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(
            f"the workers did not {what} within {config.startup_timeout_s:g}s: Ray may "
            f"lack the resources to place them (see `ray status`)") from None
