"""`pdserve sim plan`: for a profile, a workload, SLOs and a worker budget, which pool
shape serves the most goodput per worker? Every P:D split of the budget, colocated
and adaptive, each searched as DistServe searches a placement: the highest request
rate whose SLO attainment is at least the target, found by doubling then bisecting
the rate, each probe a fresh simulated cluster. A probe sends requests for at least
`min_duration_s` at its rate (so a high rate is held long enough to show whether it
holds), drawn from the same seeded workload."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pdserve.bench.sweep import TARGET_ATTAINMENT
from pdserve.bench.workloads import BenchRequest
from pdserve.router.config import PoolSpec
from pdserve.sim.driver import Load
from pdserve.sim.run import Setup, simulate

_MAX_DOUBLINGS = 20  # a shape that holds its SLOs at 2^20 x the first rate holds them


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: float


@dataclass(frozen=True)
class Searched:
    pools: PoolSpec
    max_rate: float  # the highest rate probed with attainment >= target (0: none)
    probes: tuple[Probe, ...]

    @property
    def name(self) -> str:
        p = self.pools
        return (f"{p.prefill_workers}P:{p.decode_workers}D" if p.mode == "disaggregated"
                else f"{p.mode} x{p.num_engine}")

    @property
    def goodput_per_worker(self) -> float:
        return self.max_rate / len(self.pools.roles)


def shapes(budget: int) -> list[PoolSpec]:
    """Every way to spend `budget` workers: each P:D split, all colocated, all adaptive."""
    if budget < 2:
        raise ValueError("a plan needs a budget of at least 2 workers")
    return ([PoolSpec(prefill_workers=p, decode_workers=budget - p) for p in range(1, budget)]
            + [PoolSpec(prefill_workers=0, decode_workers=budget, mode=mode)
               for mode in ("colocated", "adaptive")])


def max_rate(setup: Setup, workload: Callable[[int], list[BenchRequest]], load: Load,
             first_rate: float, iterations: int = 6, min_requests: int = 100,
             min_duration_s: float = 20.0, target: float = TARGET_ATTAINMENT,
             growth: float = 2.0) -> Searched:
    """Multiplies the rate by `growth` from first_rate until attainment falls below
    target (or divides it until it holds), then bisects `iterations` times between the
    last rate that held and the first that did not. workload(n): n requests. A known
    rate nearby (another seed's) as first_rate, with a small growth, needs fewer and
    cheaper probes."""
    if growth <= 1.0:
        raise ValueError("growth must be > 1")
    probes: list[Probe] = []

    def holds(rate: float) -> bool:
        n = max(min_requests, int(rate * min_duration_s))
        summary = simulate(setup, workload(n), replace(load, request_rate=rate))
        probes.append(Probe(rate, summary["slo_attainment"] or 0.0))
        return probes[-1].attainment >= target

    low, high = 0.0, first_rate
    for _ in range(_MAX_DOUBLINGS):
        if not holds(high):
            break
        low, high = high, growth * high
    if low == 0.0:  # the first rate failed: look below it
        for _ in range(iterations):
            high /= growth
            if holds(high):
                low, high = high, growth * high
                break
    for _ in range(iterations if low else 0):
        mid = (low + high) / 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return Searched(setup.pools, low, tuple(probes))


def plan(setup: Setup, budget: int, workload: Callable[[int], list[BenchRequest]],
         load: Load, first_rate: float, iterations: int = 6, min_requests: int = 100,
         min_duration_s: float = 20.0) -> list[Searched]:
    """Each shape's search, best goodput first. workload(n): n requests, the same
    seeded draw whatever the shape."""
    found = [max_rate(replace(setup, pools=pools), workload, load, first_rate, iterations,
                      min_requests, min_duration_s)
             for pools in shapes(budget)]
    return sorted(found, key=lambda s: (-s.goodput_per_worker, s.name))


def table(found: list[Searched], target: float = TARGET_ATTAINMENT) -> str:
    lines = [f"| pools | highest rate with >= {target:.0%} attainment (req/s) | goodput per "
             "worker (req/s) | probes |", "|---|---|---|---|"]
    for s in found:
        lines.append(f"| {s.name} | {s.max_rate:.2f} | {s.goodput_per_worker:.3f} | "
                     f"{len(s.probes)} |")
    return "\n".join(lines) + "\n"
