"""One simulated run, or a sweep of rates, each on a fresh cluster in virtual time:
what `pdserve sim` and `pdserve sim plan` call, and what the simulator's benchmarks
judge policies with."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.sweep import result
from pdserve.bench.workloads import BenchRequest
from pdserve.engine.config import SchedulerConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.sim import virtual_time
from pdserve.sim.cluster import SimCluster
from pdserve.sim.driver import Load, drive
from pdserve.sim.profile import Profile


@dataclass(frozen=True)
class Setup:
    """A simulated cluster: pdserve serve's pools, routing and engine settings, and a
    profile for the time things take."""
    profile: Profile
    pools: PoolSpec
    router: RouterConfig = RouterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    prefix_caching: bool = True
    # Host memory per device, GiB (--swap-space, --kv-offloading-size): each worker's
    # swap area and host prefix tier, in its blocks.
    swap_space: float = 0.0
    kv_offloading_size: float = 0.0
    seed: int = 0  # the workers' step noise
    # The prefill pool's workers where they differ from the others (another
    # tensor_parallel_size); None: `profile` for every worker.
    prefill_profile: Profile | None = None

    @property
    def num_workers(self) -> int:
        return len(self.pools.roles)

    @property
    def num_devices(self) -> int:
        return sum(self.profile_of(role).tensor_parallel_size for role in self.pools.roles)

    def profile_of(self, role: str) -> Profile:
        """The profile of a worker that starts in `role`."""
        return self.prefill_profile if role == "prefill" and self.prefill_profile else \
            self.profile


def simulate(setup: Setup, requests: Iterable[BenchRequest], load: Load,
             on_end: Callable[[RequestRecord], object] | None = None) -> dict:
    """The workload (a list, or an iterator drawing each request as it is sent) through
    a fresh simulated cluster: the bench's summary of it. on_end(record): each request
    as it ends."""
    def ended(record: RequestRecord) -> bool:
        on_end(record)
        return False  # never stops the run
    with virtual_time.sim_collector():
        records, duration, cluster = run_requests(setup, requests, load,
                                                  ended if on_end else None)
        return summarize(records, duration, load.slo, setup.num_workers,
                         cluster.itl.stats_ms())


def run_requests(setup: Setup, requests: Iterable[BenchRequest], load: Load,
                 until: Callable[[RequestRecord], bool] | None = None,
                 ) -> tuple[list[RequestRecord], float, SimCluster]:
    """The workload through a fresh simulated cluster: the records (of those that ended,
    when `until` stopped it: drive's), the virtual seconds it ran, and the cluster."""
    cluster = SimCluster(setup.profile, setup.pools, setup.router, setup.scheduler,
                         prefix_caching=setup.prefix_caching, seed=setup.seed,
                         host_gib=(setup.swap_space, setup.kv_offloading_size),
                         prefill_profile=setup.prefill_profile)

    async def run() -> tuple[list, float]:
        router = await cluster.start()
        try:
            return await drive(router, requests, load, until)
        finally:
            await cluster.stop()
    return (*virtual_time.run(run()), cluster)


def sweep(setup: Setup, workload: Callable[[int], Iterable[BenchRequest]], rates: list[float],
          load: Load, on_end: Callable[[RequestRecord], object] | None = None) -> dict:
    """Each rate on a fresh cluster with workload(i) for the i-th rate, and the highest
    rate (per worker) with the target SLO attainment, as `pdserve bench run --sweep`."""
    rows = [{"rate": rate, **simulate(setup, workload(i), replace(load, request_rate=rate),
                                      on_end)}
            for i, rate in enumerate(sorted(rates))]
    return result(rows, setup.num_workers)
