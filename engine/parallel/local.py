"""Every rank of a tensor-parallel engine as a thread of this process, over an
in-memory store: the sharded model without Ray (tests, debugging). The
ranks' collectives are real gloo ones over loopback; rank 0 is the engine returned.

    with threaded_engine(config) as engine:   # config.tensor_parallel_size ranks
        engine.add_request(...); engine.step()
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel.follower import Follower
from pdserve.engine.parallel.group import TensorParallelGroup

JOIN_TIMEOUT_S = 60.0


def join_threads(size: int, device: torch.device = torch.device("cpu")
                 ) -> list[TensorParallelGroup]:
    """`size` groups of one tensor-parallel group, joined on threads of this process."""
    store = dist.HashStore()
    groups: list = [None] * size

    def join(rank: int) -> None:
        groups[rank] = TensorParallelGroup.join(store, rank, size, "127.0.0.1", device)
    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    if not all(groups):
        raise TimeoutError(f"a group of {size} threads did not form in {JOIN_TIMEOUT_S:g}s")
    return groups


@contextmanager
def following(config: EngineConfig, groups: list[TensorParallelGroup],
              kv: list | None = None) -> Iterator[None]:
    """Ranks 1.. of `groups` follow rank 0 on threads while the body runs (rank 0's
    engine made and closed in it; kv: each rank's KV transfers, worker/rank_kv.py). A
    body that raises closes rank 0's group first, so the ranks' collectives fail and
    their threads end. A rank that failed raises here, after the body."""
    errors: list[BaseException] = []

    def follow(rank: int) -> None:
        try:
            Follower(config, groups[rank], kv[rank - 1] if kv else None).serve()
        except BaseException as exc:  # reported on the caller's thread
            errors.append(exc)
    threads = [threading.Thread(target=follow, args=(r,), daemon=True, name=f"tp-rank-{r}")
               for r in range(1, len(groups))]
    for t in threads:
        t.start()
    try:
        yield
    except BaseException:
        groups[0].close()
        raise
    finally:
        for t in threads:
            t.join(timeout=JOIN_TIMEOUT_S)
    if errors:
        raise RuntimeError(f"a rank failed: {errors[0]!r}") from errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a rank did not stop")


@contextmanager
def threaded_engine(config: EngineConfig) -> Iterator[LLMEngine]:
    """Rank 0's engine; ranks 1.. follow it on threads until it closes. A rank that
    failed raises here, after the engine closed."""
    groups = join_threads(config.tensor_parallel_size, torch.device(config.device))
    with following(config, groups):
        engine = LLMEngine(config, tp_group=groups[0])
        try:
            yield engine
        finally:
            engine.close()
