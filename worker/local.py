"""A served worker whose tensor-parallel ranks are threads of this process: the worker
and every rank's KV transfers without Ray (tests, debugging). The ranks' groups and
KV pairs are real gloo ones over loopback; rank 0 is the Worker yielded.

    with threaded_worker("p", config, transfer, "prefill") as worker: ...
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.local import following, join_threads
from pdserve.kv_transfer import TransferConfig
from pdserve.worker.rank_kv import RankKV
from pdserve.worker.worker import Worker


@contextmanager
def threaded_worker(worker_id: str, config: EngineConfig, transfer: TransferConfig,
                    role: str, **worker_args) -> Iterator[Worker]:
    """Rank 0's Worker; ranks 1.. follow it on threads, each with its RankKV, until it
    shuts down. A rank that failed raises here, after the worker shut down."""
    size = config.tensor_parallel_size
    groups = join_threads(size, torch.device(config.device))
    kvs = [RankKV(worker_id, rank, transfer, "127.0.0.1") for rank in range(1, size)]
    with following(config, groups, kvs):
        worker = Worker(worker_id, config, transfer, role, tp_group=groups[0],
                        rank_links=kvs, **worker_args)
        try:
            yield worker
        finally:
            worker.shutdown()
