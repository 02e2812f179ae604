"""A whole cluster in virtual time: the pools a PoolSpec names as SimWorkers (pdserve
serve's worker ids: `<role>-<n>`), booted through the engine's start-up profile, and
the production Router over them through the WorkerClient seam, on the loop's clock.
Run it on a VirtualTimeLoop (virtual_time.py)."""
from __future__ import annotations

import asyncio
import itertools
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.pool.spawner import Progress
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.pool_registry import PoolRegistry
from pdserve.router.router import Router
from pdserve.sim.itl import ItlHistogram
from pdserve.sim.profile import Profile
from pdserve.sim.tokens import TokenSource
from pdserve.sim.virtual_time import LoopClock
from pdserve.sim.worker import SimWorker

ROUTER_ID = "sim-router"


class SimCluster:
    def __init__(self, profile: Profile, pools: PoolSpec,
                 router_config: RouterConfig = RouterConfig(),
                 scheduler: SchedulerConfig = SchedulerConfig(), *, prefix_caching: bool = True,
                 seed: int = 0, tokens: Callable[[str], TokenSource] | None = None,
                 tokenizer: Tokenizer | None = None, eos_token_ids: tuple[int, ...] = (),
                 model_name: str | None = None, router_id: str = ROUTER_ID,
                 registry: PoolRegistry | None = None, prefill_profile: Profile | None = None,
                 host_gib: tuple[float, float] = (0.0, 0.0)):
        """tokens(worker_id): each worker's token source (default: synthetic);
        tokenizer: the router's (default: none, token ids only); registry: the
        router's (default: what router_config.shared asks for; a pool of simulated
        workers lives in one process: other replicas cannot attach to it);
        prefill_profile: the workers started as prefill workers' (another
        tensor_parallel_size), where it differs from `profile`; host_gib: host memory
        per device for the swap area and the prefix tier (--swap-space,
        --kv-offloading-size)."""
        if prefill_profile is not None and (
                prefill_profile.kv_bytes_per_block, prefill_profile.block_size,
                prefill_profile.max_model_len, prefill_profile.vocab_size) != (
                profile.kv_bytes_per_block, profile.block_size, profile.max_model_len,
                profile.vocab_size):
            raise ValueError("the prefill profile must be of the same model and blocks")
        self.router_id, self.registry = router_id, registry
        self.profile, self.pools, self.scheduler = profile, pools, scheduler
        self.prefill_profile = prefill_profile
        self.router_config = replace(router_config, adaptive=pools.mode == "adaptive")
        self.prefix_caching, self.seed, self.tokens = prefix_caching, seed, tokens
        self.host_gib = host_gib
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.model = ModelInfo(name=model_name or profile.name,
                               max_model_len=profile.max_model_len,
                               vocab_size=profile.vocab_size, block_size=profile.block_size,
                               kv_bytes_per_block=profile.kv_bytes_per_block)
        self.workers: dict[str, SimWorker] = {}  # every worker ever started, by id (address)
        self.itl = ItlHistogram()  # the gaps between tokens, as the workers made them
        self.router: Router | None = None
        self._numbers: defaultdict[str, itertools.count] = defaultdict(itertools.count)

    async def start(self) -> Router:
        """Boots the pools (in virtual time), then the router over them."""
        workers = [self._create(role) for role in self.pools.roles]
        await asyncio.gather(*(w.boot() for w in workers))
        self.router = Router(self.tokenizer, self.model, [_handle(w) for w in workers],
                             self.router_config, spawner=self,
                             clock=LoopClock(asyncio.get_running_loop()),
                             router_id=self.router_id, registry=self.registry)
        await self.router.start()
        return self.router

    async def __call__(self, role: str, progress: Progress) -> WorkerHandle:
        return await self.spawn(role, progress)

    def wanted(self, workers: dict[str, int]) -> None:
        """Every simulated worker is placed at once: nothing to ask for."""

    async def attach(self, locator: str) -> SimWorker:
        """A worker another router over this cluster started (its locator: its id)."""
        return self.workers[locator]

    async def spawn(self, role: str, progress: Progress = lambda worker_id, state: None
                    ) -> WorkerHandle:
        """A fresh worker of `role`, booted, not yet paired or subscribed (the Pool's
        spawner: admin add, replacement of an evicted worker, the planner). It is
        placed at once: "starting" while it boots."""
        worker = self._create(role)
        progress(worker.worker_id, "starting")
        await worker.boot()
        return _handle(worker)

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for worker in self.workers.values():
            worker.kill()

    def _create(self, role: str) -> SimWorker:
        worker_id = f"{role}-{next(self._numbers[role])}"
        # self.workers is every worker's peers too: a transfer finds its target there
        # A worker keeps the profile it started with (its devices) through role flips.
        profile = self.prefill_profile if role == "prefill" and self.prefill_profile \
            else self.profile
        worker = SimWorker(worker_id, role, profile, self.scheduler, self.workers,
                           seed=zlib.crc32(f"{self.seed}:{worker_id}".encode()),
                           tokens=self.tokens(worker_id) if self.tokens else None,
                           prefix_caching=self.prefix_caching,
                           eos_token_ids=self.eos_token_ids, itl=self.itl,
                           host_blocks=host_blocks(profile, *self.host_gib))
        return worker


def host_blocks(profile: Profile, swap_gib: float, offloading_gib: float) -> tuple[int, int]:
    """A worker's swap area and host prefix tier in blocks: GiB per device over the
    bytes of one rank's share of a block."""
    rank_block = profile.kv_bytes_per_block / profile.tensor_parallel_size
    if not rank_block:
        return 0, 0
    return (int(swap_gib * (1 << 30) // rank_block),
            int(offloading_gib * (1 << 30) // rank_block))


def _handle(worker: SimWorker) -> WorkerHandle:
    return WorkerHandle.of(worker.worker_id, worker, worker.role,
                           num_blocks=worker.blocks.num_blocks, address=worker.worker_id,
                           locator=worker.worker_id)
