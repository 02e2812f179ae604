"""A tensor-parallel rank other than 0: its shard of the model and of the KV cache,
computing each step rank 0 broadcasts, until rank 0 says stop."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_memory import keep_freed_memory
from pdserve.engine.engine import max_model_len_of
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.messages import Forward, InitKVCache, Shutdown

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, config: EngineConfig, group: TensorParallelGroup):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()
        model_dir = resolve_model_path(config.model)
        model_config = ModelConfig.from_dir(model_dir)
        self.group = group
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

    def _serve(self) -> int:
        steps = 0
        while True:
            message = self.group.receive()
            if isinstance(message, Forward):
                self.runner.run_step(message.step)
                steps += 1
            elif isinstance(message, InitKVCache):
                self.runner.init_kv_cache(message.num_blocks)
            elif isinstance(message, Shutdown):
                self.runner.close()
                return steps
            else:
                raise TypeError(f"unknown message from rank 0: {type(message).__name__}")
