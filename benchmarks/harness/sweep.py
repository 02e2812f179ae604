"""A rate sweep: the same workload at each request rate, and the highest rate per
worker that still holds the SLO attainment target (linearly interpolated)."""
from __future__ import annotations

from dataclasses import replace

from benchmarks.harness import driver
from benchmarks.harness.metrics import SLO, crossing, summarize
from benchmarks.harness.workloads import BenchRequest

TARGET_ATTAINMENT = 0.9


async def sweep(requests: list[BenchRequest], cfg: driver.RunConfig, rates: list[float],
                slo: SLO, num_workers: int = 1) -> dict:
    rows = []
    for rate in sorted(rates):
        records, duration = await driver.run(requests, replace(cfg, request_rate=rate))
        rows.append({"rate": rate, **summarize(records, duration, slo, num_workers)})
    best = crossing([r["rate"] for r in rows], [r["slo_attainment"] for r in rows],
                    TARGET_ATTAINMENT)
    return {"rows": rows, "target_attainment": TARGET_ATTAINMENT,
            "max_rate": best,
            "max_rate_per_worker": None if best is None else best / num_workers}
