"""A tensor-parallel rank other than 0: its shard of the model and of the KV cache,
computing each step rank 0 broadcasts, until rank 0 says stop.

In a served worker the rank also sends and receives its own KV heads
(worker/rank_kv.py): `kv` gets the cache once allocated, and each step's exports
(the requests whose KV this rank streams as its forward pass writes it)."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Protocol

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_memory import keep_freed_memory
from pdserve.engine.engine import max_model_len_of
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.messages import CopyKV, Forward, InitKVCache, RankExport, Shutdown

log = logging.getLogger(__name__)


class RankTransfers(Protocol):
    """A rank's part in its worker's KV transfers (worker/rank_kv.py)."""

    def attach(self, kv_caches: list[torch.Tensor]) -> None: ...

    def export(self, exports: tuple[RankExport, ...]) -> Callable[[int], None] | None: ...

    def close(self) -> None: ...


class Follower:
    def __init__(self, config: EngineConfig, group: TensorParallelGroup,
                 kv: RankTransfers | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()
        model_dir = resolve_model_path(config.model)
        model_config = ModelConfig.from_dir(model_dir)
        self.group = group
        self.kv = kv
        try:
            self.runner = ModelRunner(replace(config, model=str(model_dir)), model_config,
                                      max_model_len_of(config, model_config), group)
        except BaseException:
            group.close()  # rank 0 learns at its first broadcast, not never
            raise

    def serve(self) -> int:
        """Runs rank 0's messages until its Shutdown; returns the steps computed. A
        failed step (or a lost rank 0) raises, its group closed first, so rank 0's next
        collective fails at once instead of waiting on this rank."""
        try:
            return self._serve()
        except BaseException:
            log.exception("tensor-parallel rank %d failed", self.group.rank)
            self.runner.close()
            raise
        finally:
            if self.kv is not None:
                self.kv.close()

    def _serve(self) -> int:
        steps = 0
        while True:
            message = self.group.receive()
            if isinstance(message, Forward):
                send = self.kv.export(message.exports) \
                    if self.kv is not None and message.exports else None
                self.runner.run_step(message.step, None, send)
                steps += 1
            elif isinstance(message, CopyKV):
                self.runner.copy_kv(message.copies)
            elif isinstance(message, InitKVCache):
                self.runner.init_kv_cache(message.num_blocks, message.num_host_blocks)
                if self.kv is not None:
                    self.kv.attach(self.runner.kv_caches)
            elif isinstance(message, Shutdown):
                self.runner.close()
                return steps
            else:
                raise TypeError(f"unknown message from rank 0: {type(message).__name__}")
