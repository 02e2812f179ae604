"""The pool registry: the workers of one pool, as every router replica over it must
see them. A replica that changes the membership (a worker joins, drains, resumes,
changes role, restarts, leaves) records the change and every other replica applies
it; a replica that starts later finds the pool (the Ray cluster, the model, how to
start workers like the others) and every worker in it.

`LocalRegistry` is the embedded default (one router: its pool is the whole
registry); `RedisRegistry` (redis_registry.py) shares it with `--redis-url`."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Callable, Protocol

from pdserve.router.model_info import ModelInfo

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.kv_transfer import TransferConfig
    from pdserve.router.config import PoolSpec, SharedStateSpec


class RegistryError(RuntimeError):
    """The pool cannot be registered (another is) or found (none is)."""


@dataclass(frozen=True)
class WorkerEntry:
    """One worker as the replicas share it."""
    worker_id: str
    role: str
    draining: bool
    locator: str  # how to reach it: its Ray actor's name in the pool's namespace
    address: str  # its kv_transfer rendezvous ("" for a worker that decodes nothing)
    num_blocks: int
    # Its process's incarnation (WorkerStats.incarnation): a restarted worker has a new
    # one, so an entry written for its earlier process is never taken for the live one.
    generation: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "WorkerEntry":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class PoolRecord:
    """What a replica that starts later needs to serve the pool and to start workers
    exactly as the others do."""
    pool_id: str  # names this pool's actors (a crashed earlier pool's never collide)
    ray_address: str  # the Ray cluster's GCS address
    namespace: str  # the Ray namespace of the workers' named actors
    model_dir: str  # where the model (its tokenizer) is, on every node
    model: ModelInfo
    adaptive: bool
    engine: dict  # the engine's flat arguments (EngineConfig.from_kwargs)
    pools: dict  # PoolSpec's fields
    transfer: dict  # TransferConfig's fields, the cluster's rendezvous secret included

    @classmethod
    def of(cls, pool_id: str, ray_address: str, namespace: str, model: ModelInfo,
           adaptive: bool, engine: EngineConfig, pools: PoolSpec,
           transfer: TransferConfig) -> "PoolRecord":
        flat = {f.name: getattr(engine, f.name) for f in fields(engine)
                if f.name not in ("scheduler", "cache")}
        flat.update(asdict(engine.scheduler), **asdict(engine.cache))
        return cls(pool_id=pool_id, ray_address=ray_address, namespace=namespace,
                   model_dir=engine.model, model=model, adaptive=adaptive, engine=flat,
                   pools=asdict(pools), transfer=asdict(transfer))

    def engine_config(self) -> EngineConfig:
        from pdserve.engine.config import EngineConfig
        flat = dict(self.engine)
        return EngineConfig.from_kwargs(flat.pop("model"), **flat)

    def pool_spec(self) -> PoolSpec:
        from pdserve.router.config import PoolSpec
        return PoolSpec(**self.pools)

    def transfer_config(self) -> TransferConfig:
        from pdserve.kv_transfer import TransferConfig
        return TransferConfig(**self.transfer)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "PoolRecord":
        data = json.loads(text)
        return cls(**{**data, "model": ModelInfo(**data["model"])})


# (worker id, its entry, or None when it left) -> None
Applied = Callable[[str, "WorkerEntry | None"], None]
# (replica id) -> None: that replica stopped renewing (it died)
Gone = Callable[[str], None]


class PoolRegistry(Protocol):
    shared: bool  # whether other replicas may change the membership

    async def start(self, record: PoolRecord | None, entries: list[WorkerEntry],
                    apply: Applied, gone: Gone) -> None:
        """Registers the pool (record: this replica launched it) or joins it, records
        `entries` (this replica's workers) and begins applying the changes other
        replicas make: apply(worker_id, entry) for a worker that joined or changed,
        apply(worker_id, None) for one that left. gone(replica_id): a replica died
        (its heartbeat expired); one live replica hears of each."""

    async def stop(self) -> bool:
        """Stops applying changes; True when no other replica serves the pool any
        longer (the last one ends it: its workers, its entries)."""

    def changed(self, entry: WorkerEntry) -> None:
        """This replica changed the worker: recorded and told to the others, in order,
        off the caller's path."""

    def left(self, worker_id: str) -> None:
        """The worker left through this replica."""

    async def next_worker_number(self) -> int | None:
        """A number no worker of the pool has had (None: make one up locally)."""


class LocalRegistry:
    """One router alone: nothing to share."""
    shared = False

    async def start(self, record: PoolRecord | None, entries: list[WorkerEntry],
                    apply: Applied, gone: Gone) -> None:
        pass

    async def stop(self) -> bool:
        return True

    def changed(self, entry: WorkerEntry) -> None:
        pass

    def left(self, worker_id: str) -> None:
        pass

    async def next_worker_number(self) -> int | None:
        return None


def registry_for(spec: SharedStateSpec, replica_id: str) -> PoolRegistry:
    """The registry `--redis-url` asks for: Redis's, or this router's alone."""
    if not spec.redis_url:
        return LocalRegistry()
    from pdserve.router.replicas.redis_client import connect
    from pdserve.router.replicas.redis_registry import RedisRegistry

    return RedisRegistry(connect(spec), spec.redis_prefix, replica_id, spec.registry_ttl_s)
