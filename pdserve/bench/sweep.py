"""A rate sweep: the same workload at each request rate, and the highest rate per
worker that still holds the SLO attainment target (linearly interpolated)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from pdserve.bench import driver
from pdserve.bench.metrics import SLO, crossing, summarize
from pdserve.bench.workloads import BenchRequest

TARGET_ATTAINMENT = 0.9
WARMUP_REQUESTS = 4


async def sweep(workload: Callable[[int], list[BenchRequest]], cfg: driver.RunConfig,
                rates: list[float], slo: SLO, num_workers: int = 1) -> dict:
    """`workload(i)` gives the requests of run i: each rate gets prompts of its own, so
    a later rate never rides the prefix cache an earlier one filled. A short burst from
    workload(-1) warms the servers up first and is not counted."""
    await driver.run(workload(-1)[:WARMUP_REQUESTS], replace(cfg, request_rate=float("inf"),
                                                             progress=False))
    rows = []
    for i, rate in enumerate(sorted(rates)):
        records, duration = await driver.run(workload(i), replace(cfg, request_rate=rate))
        rows.append({"rate": rate, **summarize(records, duration, slo, num_workers)})
    return result(rows, num_workers)


def result(rows: list[dict], num_workers: int) -> dict:
    """A sweep's rows (each a rate and its summary, by rate) and its crossing: the
    highest rate, and rate per worker, with the target attainment."""
    best = crossing([r["rate"] for r in rows], [r["slo_attainment"] for r in rows],
                    TARGET_ATTAINMENT)
    return {"rows": rows, "target_attainment": TARGET_ATTAINMENT,
            "max_rate": best,
            "max_rate_per_worker": None if best is None else best / num_workers}
