"""`pdserve bench compare`: the project's headline number in one run.

The same model, workload and SLOs against the cluster in disaggregated mode (P prefill
+ D decode workers) and in colocated mode (P + D engine workers). SLOs may be set
relative to isolated latencies measured first, in-process: TTFT SLO = k x the prefill
time of the workload's median prompt alone; TPOT SLO = k x one decode step alone.
The figure is the ratio of the two modes' highest per-worker rates with >= 90% SLO
attainment (goodput per worker).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.bench import driver
from pdserve.bench.metrics import SLO
from pdserve.bench.sweep import sweep
from pdserve.bench.workloads import BenchRequest
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Isolated:
    prefill_s: float  # the median prompt, alone
    decode_step_s: float  # one token of one request, alone


def measure_isolated(config: EngineConfig, requests: list[BenchRequest],
                     repeats: int = 5) -> Isolated:
    engine = LLMEngine(config)
    lengths = sorted(len(r.prompt) for r in requests if not isinstance(r.prompt, str))
    median = next(r.prompt for r in requests if len(r.prompt) == lengths[len(lengths) // 2])
    prefills, steps = [], []
    for i in range(repeats + 1):
        prompt = [(t + i) % engine.model_config.vocab_size for t in median]  # no cache hits
        engine.add_request(f"iso-p{i}", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                                 ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        prefills.append(time.perf_counter() - t0)
        engine.add_request(f"iso-d{i}", prompt[:8], SamplingParams(max_tokens=17, temperature=0,
                                                                    ignore_eos=True))
        engine.step()  # its prefill
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        steps.append((time.perf_counter() - t0) / 16)
    return Isolated(statistics.median(prefills[1:]), statistics.median(steps[1:]))


def slo_for(isolated: Isolated, ttft_scale: float, tpot_scale: float) -> SLO:
    return SLO(ttft_ms=ttft_scale * isolated.prefill_s * 1e3,
               tpot_ms=tpot_scale * isolated.decode_step_s * 1e3)


def run_mode(mode: str, config: EngineConfig, prefill_workers: int, decode_workers: int,
             workload: Callable[[int], list[BenchRequest]], rates: list[float], slo: SLO,
             burstiness: float, seed: int) -> dict:
    import ray

    from pdserve import ray_session
    from pdserve.router.config import PoolSpec
    from pdserve.router.front.server import RouterServer
    from pdserve.router.launch import launch

    workers = prefill_workers + decode_workers
    ray_session.start_local(num_cpus=max(4, workers + 2), include_dashboard=False,
                            log_to_driver=False)
    try:
        router = launch(config, PoolSpec(prefill_workers, decode_workers, mode))
        server = RouterServer(router)
        try:
            cfg = driver.RunConfig("grpc", server.grpc_target, burstiness=burstiness, seed=seed,
                                   slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms)
            result = asyncio.run(sweep(workload, cfg, rates, slo, workers))
        finally:
            server.stop()
    finally:
        ray.shutdown()
    return {"mode": mode, "workers": workers, **result}


def ratio(disaggregated: dict, colocated: dict) -> float | None:
    d, c = disaggregated["max_rate_per_worker"], colocated["max_rate_per_worker"]
    if d is None or not c:
        return None
    return d / c
