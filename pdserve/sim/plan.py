"""`pdserve sim plan`: for a profile, a workload, SLOs and a device budget, which pool
shape serves the most goodput per device? Every P:D split of the budget, colocated
and adaptive, for each tensor_parallel_size of prefill and of decode workers searched
(DistServe's method: each phase's parallelism chosen apart), each searched as
DistServe searches a placement: the highest request
rate whose SLO attainment is at least the target. A probe sends requests for at least
`min_duration_s` at its rate (so a high rate is held long enough to show whether it
holds), drawn from the same seeded workload, through a fresh simulated cluster.

One shape's search: from a first rate, the rate is multiplied by `growth` while it
holds (divided while it fails), then bisected until the bracket is narrower than
2^-iterations of the rate that held. A probe stops as soon as its verdict is certain:
once enough requests met their SLOs that the rest cannot pull the attainment under
the target, or enough missed that they cannot lift it over.

Shapes next to each other serve similar rates, so a shape starts from its neighbour's
result with a small growth (a bracket of 1.25x, not 2x, and no climb from the first
rate): the P:D splits outward from the even split, two chains on each side, adaptive
from colocated (`neighbours`). Which neighbour is fixed, so the table does not depend on
how many shapes run at once (`jobs`, in processes of their own).

A probe lasts long enough for the search's precision (`min_duration_s`), and its
requests are the first n of one seeded sequence, drawn once per process (`Draws`)."""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.pool
import queue
import time
from array import array
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from pdserve.bench.metrics import SLO, RequestRecord
from pdserve.bench.sweep import TARGET_ATTAINMENT
from pdserve.bench.workloads import BenchRequest
from pdserve.router.config import PoolSpec
from pdserve.sim import virtual_time
from pdserve.sim.driver import Load
from pdserve.sim.profile import Profile
from pdserve.sim.run import Setup, run_requests

_MIN_DURATION_S = 5.0
_MAX_STEPS = 20  # a shape that holds its SLOs at 2^20 x the first rate holds them
NEIGHBOUR_GROWTH = 1.25
_POLL_S = 0.2  # how often the parent reads its children's probes


@dataclass(frozen=True)
class Probe:
    rate: float
    holds: bool  # attainment >= target
    attainment: float | None  # the whole probe's; None where the verdict came early
    ended: int  # requests that had ended when the verdict was certain
    requests: int  # the probe's requests
    wall_s: float


@dataclass(frozen=True)
class Shape:
    """A pool shape a plan searches: the pools, and each pool's tensor_parallel_size
    (the devices one of its workers takes)."""
    pools: PoolSpec
    prefill_tp: int = 1  # disaggregated: each prefill worker's
    decode_tp: int = 1  # each decode worker's; colocated and adaptive: every worker's

    @property
    def devices(self) -> int:
        p = self.pools
        if p.mode == "disaggregated":
            return p.prefill_workers * self.prefill_tp + p.decode_workers * self.decode_tp
        return p.num_engine * self.decode_tp

    @property
    def name(self) -> str:
        base = name_of(self.pools)
        if self.prefill_tp == self.decode_tp == 1:
            return base
        if self.pools.mode == "disaggregated":
            return f"{base} TP {self.prefill_tp}:{self.decode_tp}"
        return f"{base} TP {self.decode_tp}"


@dataclass(frozen=True)
class Searched:
    pools: PoolSpec
    max_rate: float  # the highest rate probed that held (0: none)
    probes: tuple[Probe, ...]
    shape: Shape | None = None  # what was searched (its pools are `pools`)

    @property
    def name(self) -> str:
        return self.shape.name if self.shape else name_of(self.pools)

    @property
    def devices(self) -> int:
        return self.shape.devices if self.shape else len(self.pools.roles)

    @property
    def goodput_per_worker(self) -> float:
        return self.max_rate / len(self.pools.roles)

    @property
    def goodput_per_device(self) -> float:
        return self.max_rate / self.devices


def name_of(pools: PoolSpec) -> str:
    return (f"{pools.prefill_workers}P:{pools.decode_workers}D"
            if pools.mode == "disaggregated" else f"{pools.mode} x{pools.num_engine}")


def shapes(budget: int, tp_sizes: tuple[int, ...] = (1,)) -> list[Shape]:
    """Every way to spend `budget` devices with workers of the given sizes: for each
    (prefill, decode) tensor_parallel_size pair, each P:D split that leaves fewer
    devices than a decode worker takes unused; then for each size, all colocated and
    all adaptive (DistServe's search over each phase's parallelism)."""
    smallest = min(tp_sizes)
    if budget < 2 * smallest:
        raise ValueError(f"a plan needs a budget of at least {2 * smallest} devices")
    found = []
    for prefill_tp in tp_sizes:
        for decode_tp in tp_sizes:
            for p in range(1, budget):
                d = (budget - p * prefill_tp) // decode_tp
                if d < 1:
                    break
                found.append(Shape(PoolSpec(prefill_workers=p, decode_workers=d),
                                   prefill_tp, decode_tp))
    for tp in tp_sizes:
        n = budget // tp
        for mode in ("colocated", "adaptive"):
            if n >= (1 if mode == "colocated" else 2):
                found.append(Shape(PoolSpec(prefill_workers=0, decode_workers=n, mode=mode),
                                   tp, tp))
    return found


def neighbours(all_shapes: list[Shape]) -> list[int | None]:
    """For each shape, the index of the shape it starts from, or None for a search
    from the first rate: each family's even split (prefill and decode devices nearest
    equal) and colocated. A split k splits from its family's even one starts from the
    split two nearer (one, next to it), adaptive from colocated of its size. A chain
    of splits is searched one after another; stepping by two makes two chains on each
    side of the even split, each half as long as a chain of every split: with 16
    workers the high-rate splits were a chain of 8 searches (7 now 4), most of the
    plan's wall time with two jobs."""
    after: list[int | None] = [None] * len(all_shapes)
    families: dict[tuple[int, int], list[int]] = {}
    colocated: dict[int, int] = {}
    for i, s in enumerate(all_shapes):
        if s.pools.mode == "disaggregated":
            families.setdefault((s.prefill_tp, s.decode_tp), []).append(i)
        elif s.pools.mode == "colocated":
            colocated[s.decode_tp] = i
    for members in families.values():
        def imbalance(i: int) -> tuple[int, int]:
            s = all_shapes[i]
            p = s.pools
            return abs(p.prefill_workers * s.prefill_tp - p.decode_workers * s.decode_tp), \
                p.prefill_workers
        even = members.index(min(members, key=imbalance))
        for j, i in enumerate(members):
            if j != even:
                toward = 2 if abs(j - even) >= 2 else 1
                after[i] = members[j + toward if j < even else j - toward]
    for i, s in enumerate(all_shapes):
        if s.pools.mode == "adaptive":
            after[i] = colocated.get(s.decode_tp)
    return after


def min_duration_s(slo: SLO, iterations: int, target: float = TARGET_ATTAINMENT) -> float:
    """How long a probe must send for a rate 2^-iterations above what the cluster
    sustains to fail, so the search's precision is the probe's too: its queue grows by
    2^-iterations seconds of work a second, so a request waits past the TTFT SLO from
    ttft / 2^-iterations seconds on, and more than 1 - target of the probe's requests
    do once it lasts that over target (the TTFT the queue adds to, and the headroom a
    placement keeps, only shorten it). Without a TTFT SLO (a TPOT SLO is broken at
    once, with no queue), _MIN_DURATION_S."""
    if slo.ttft_ms is None:
        return _MIN_DURATION_S
    return max(_MIN_DURATION_S, slo.ttft_ms / 1e3 / 2.0 ** -iterations / target)


class Verdict:
    """Whether good / n >= target over a probe's n requests, fed each as it ends; True
    once the requests ended so far make it certain either way."""

    def __init__(self, n: int, target: float, slo: SLO):
        self.n, self.slo = n, slo
        self.need = math.ceil(target * n)  # the fewest good requests that hold
        while self.need > 0 and (self.need - 1) / n >= target:
            self.need -= 1
        while self.need <= n and self.need / n < target:
            self.need += 1
        self.good = self.missed = 0

    def __call__(self, record: RequestRecord) -> bool:
        if self.slo.met(record):
            self.good += 1
        else:
            self.missed += 1
        return self.holds or self.missed > self.n - self.need

    @property
    def holds(self) -> bool:
        return self.good >= self.need


class Draws:
    """A search's workload: workload(n) is the first n requests of one seeded sequence
    (the same requests whatever the shape or rate), each drawn the first time a probe
    of this process sends it and kept (a prompt as int32, 4 bytes a token) for the
    probes after it, which read it back rather than draw it again (drawing an
    azure-code prompt costs about as much as simulating a fifth of its request). A
    probe whose verdict comes early draws none of the requests it did not send.
    draw(): a fresh iterator over the sequence; picklable, as a process gets its own
    (empty) copy."""

    def __init__(self, draw: Callable[[], Iterator[BenchRequest]]):
        self._draw = draw
        self._source: Iterator[BenchRequest] | None = None
        self._kept: list[tuple[array, int]] = []  # (prompt, max_tokens)

    def __call__(self, n: int) -> _First:
        return _First(self, n)

    def __getstate__(self) -> dict:
        return {"_draw": self._draw, "_source": None, "_kept": []}

    def at(self, i: int) -> BenchRequest:
        while len(self._kept) <= i:
            if self._source is None:
                self._source = self._draw()
            req = next(self._source)
            self._kept.append((array("i", req.prompt), req.max_tokens))
        prompt, max_tokens = self._kept[i]
        return BenchRequest(prompt.tolist(), max_tokens)


@dataclass(frozen=True)
class _First:
    """The first n requests of a Draws, drawn as they are read."""
    draws: Draws
    n: int

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[BenchRequest]:
        return map(self.draws.at, range(self.n))


def probe(setup: Setup, requests: list[BenchRequest] | _First, load: Load,
          target: float = TARGET_ATTAINMENT) -> Probe:
    """The workload at load's rate through a fresh simulated cluster, stopped once its
    verdict is certain."""
    verdict = Verdict(len(requests), target, load.slo)
    began = time.perf_counter()
    with virtual_time.sim_collector():
        run_requests(setup, requests, load, verdict)  # the verdict counted every ending
    ended = verdict.good + verdict.missed
    return Probe(rate=load.request_rate, holds=verdict.holds,
                 attainment=verdict.good / ended if ended == len(requests) else None,
                 ended=ended, requests=len(requests), wall_s=time.perf_counter() - began)


def max_rate(setup: Setup, workload: Callable[[int], list[BenchRequest] | _First], load: Load,
             first_rate: float, iterations: int = 5, min_requests: int = 100,
             min_duration_s: float = 20.0, target: float = TARGET_ATTAINMENT,
             growth: float = 2.0, on_probe: Callable[[Probe], None] | None = None,
             ) -> Searched:
    """The search (the module's docstring). workload(n): n requests."""
    if growth <= 1.0 or not first_rate > 0:
        raise ValueError("growth must be > 1 and first_rate > 0")
    probes: list[Probe] = []

    def holds(rate: float) -> bool:
        n = max(min_requests, int(rate * min_duration_s))
        probes.append(probe(setup, workload(n), replace(load, request_rate=rate), target))
        if on_probe is not None:
            on_probe(probes[-1])
        return probes[-1].holds

    def found(rate: float) -> Searched:
        return Searched(setup.pools, rate, tuple(probes))

    rate = first_rate
    if holds(rate):
        for _ in range(_MAX_STEPS):
            if not holds(rate * growth):
                low, high = rate, rate * growth
                break
            rate *= growth
        else:
            return found(rate)
    else:
        for _ in range(_MAX_STEPS):
            if holds(rate / growth):
                low, high = rate / growth, rate
                break
            rate /= growth
        else:
            return found(0.0)
    while high - low > low * 2.0 ** -iterations:
        mid = (low + high) / 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return found(low)


@dataclass(frozen=True)
class Search:
    """What every shape's search shares (picklable: it goes to the processes)."""
    setup: Setup
    workload: Callable[[int], list[BenchRequest] | _First]  # n requests: a Draws, as a rule
    load: Load
    first_rate: float
    iterations: int = 5
    min_requests: int = 100
    min_duration_s: float = 20.0
    # (tensor_parallel_size, its workers' profile) for each size searched; empty:
    # setup.profile for every worker, a size of 1.
    profiles: tuple[tuple[int, Profile], ...] = ()

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tuple(n for n, _ in self.profiles) or (1,)

    def run(self, shape: Shape, start: float | None,
            on_probe: Callable[[Probe], None] | None = None) -> Searched:
        """One shape's search, from a neighbour's rate (`start`) or the first rate."""
        near = start is not None and start > 0
        setup = replace(self.setup, pools=shape.pools)
        if self.profiles:
            by_size = dict(self.profiles)
            setup = replace(setup, profile=by_size[shape.decode_tp], prefill_profile=(
                by_size[shape.prefill_tp] if shape.prefill_tp != shape.decode_tp else None))
        found = max_rate(setup, self.workload, self.load,
                         start if near else self.first_rate, self.iterations,
                         self.min_requests, self.min_duration_s,
                         growth=NEIGHBOUR_GROWTH if near else 2.0, on_probe=on_probe)
        return replace(found, shape=shape)


def plan(search: Search, budget: int, jobs: int = 1,
         on_probe: Callable[[Shape, Probe], None] | None = None) -> Iterator[Searched]:
    """Each shape's search (shapes(budget, search.tp_sizes)), yielded as it ends: one
    after another in this process, or (jobs > 1) `jobs` at once, each in a process of
    its own. on_probe(shape, probe): each probe as it ends."""
    if jobs < 1:
        raise ValueError("jobs must be >= 1")
    all_shapes = shapes(budget, search.tp_sizes)
    after = neighbours(all_shapes)
    results: dict[int, Searched] = {}

    def ready() -> list[int]:
        """Those whose neighbour is done, the dearest first (a search from the first
        rate, then from the highest rate): the chain of high-rate splits is the
        longest wait, and is started as soon as it can be."""
        found = [i for i in range(len(all_shapes)) if i not in results
                 and (after[i] is None or after[i] in results)]
        return sorted(found, key=lambda i: -(start_of(i) or math.inf))

    def start_of(i: int) -> float | None:
        return None if after[i] is None else results[after[i]].max_rate

    if jobs == 1:
        while len(results) < len(all_shapes):
            i = ready()[0]
            shape = all_shapes[i]
            results[i] = search.run(shape, start_of(i),
                                    on_probe and (lambda p, shape=shape: on_probe(shape, p)))
            yield results[i]
        return
    context = multiprocessing.get_context("spawn")
    # A Pool, whose exit terminates its processes: a plan stopped (Ctrl-C, or its
    # caller closing this generator) leaves no search running on.
    with context.Manager() as manager, context.Pool(jobs) as pool:
        events = manager.Queue()
        running: dict[int, multiprocessing.pool.AsyncResult] = {}
        while len(results) < len(all_shapes):
            for i in ready():
                if i not in running:
                    running[i] = pool.apply_async(
                        _run_in_child, (search, all_shapes[i], start_of(i), events))
            _drain(events, on_probe, _POLL_S)
            for i in [i for i, r in running.items() if r.ready()]:
                results[i] = running.pop(i).get()
                yield results[i]


def _run_in_child(search: Search, shape: Shape, start: float | None, events) -> Searched:
    return search.run(shape, start, lambda p: events.put((shape, p)))


def _drain(events, on_probe, wait_s: float) -> None:
    """The children's probes, after waiting for one at most wait_s."""
    timeout: float | None = wait_s
    while True:
        try:
            shape, p = events.get(timeout=timeout) if timeout else events.get_nowait()
        except queue.Empty:
            return
        timeout = None
        if on_probe is not None:
            on_probe(shape, p)


def best_first(found: list[Searched]) -> list[Searched]:
    return sorted(found, key=lambda s: (-s.goodput_per_device, s.name))


def table_header(target: float = TARGET_ATTAINMENT) -> str:
    return (f"| pools | devices | highest rate with >= {target:.0%} attainment (req/s) | "
            "goodput per device (req/s) | probes |\n|---|---|---|---|---|\n")


def table_row(s: Searched) -> str:
    return (f"| {s.name} | {s.devices} | {s.max_rate:.2f} | {s.goodput_per_device:.3f} | "
            f"{len(s.probes)} |\n")


def table(found: list[Searched], target: float = TARGET_ATTAINMENT) -> str:
    return table_header(target) + "".join(map(table_row, best_first(found)))
