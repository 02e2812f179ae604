"""Where a simulated worker's sampled tokens come from. Synthetic by default: the
simulator measures time, and any token does; a request's tokens are a function of
its position, so a run is the same every time. With a model (`ModelTokens`, the real
engine's ModelRunner over the worker's own KV blocks) the tokens are the model's,
exact against HF, which router tests use to check token streams end to end."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

_FIRST_ID = 4  # below: the special tokens of small vocabularies


class TokenSource(Protocol):
    # Whether following() can tell a steady batch's next tokens without a model: the
    # simulated worker then runs such a batch many steps at a time.
    coasts: bool

    def following(self, request: Request, steps: int) -> list[int]:
        """The tokens the request's next `steps` steps sample (only if `coasts`)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The tokens sampled by the step `out` scheduled (requests whose chunk
        reaches their last known token)."""

    def copy_kv(self, source_blocks: list[int], target: "TokenSource",
                target_blocks: list[int]) -> None:
        """A transfer's KV: these blocks of this worker's cache into the target's."""

    def forget(self, request_id: str) -> None:
        """The request finished: whatever was kept for it goes."""


class SyntheticTokens:
    coasts = True

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def at(self, request: Request, position: int) -> int:
        """The token sampled to follow `position` tokens of the request."""
        return _FIRST_ID + (position * 2654435761 + request.prompt_token_ids[0]) \
            % (self.vocab_size - _FIRST_ID)

    def following(self, request: Request, steps: int) -> list[int]:
        positions = np.arange(request.num_tokens, request.num_tokens + steps, dtype=np.int64)
        return (_FIRST_ID + (positions * 2654435761 + request.prompt_token_ids[0])
                % (self.vocab_size - _FIRST_ID)).tolist()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids={
            r.request_id: self.at(r, r.num_tokens) for r, n in zip(out.requests, out.num_scheduled)
            if r.num_computed_tokens + n == r.num_tokens})

    def copy_kv(self, source_blocks, target, target_blocks) -> None:
        pass  # no KV: only its time is simulated

    def forget(self, request_id: str) -> None:
        pass


class ModelTokens:
    """The real engine's forward pass and sampler (engine/model_runner.py) over a KV
    cache of the simulated worker's blocks."""
    coasts = False  # every step runs the model

    def __init__(self, runner):
        self.runner = runner  # a ModelRunner with its KV cache initialized

    @classmethod
    def load(cls, model_dir: str, num_blocks: int, block_size: int, max_model_len: int,
             seed: int = 0) -> "ModelTokens":
        """The model of a local HF directory on CPU, its KV cache `num_blocks` blocks."""
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.model_config import ModelConfig
        from pdserve.engine.model_runner import ModelRunner

        config = EngineConfig.from_kwargs(model_dir, block_size=block_size,
                                          num_kv_blocks=num_blocks,
                                          max_model_len=max_model_len, seed=seed)
        runner = ModelRunner(config, ModelConfig.from_dir(model_dir), max_model_len)
        runner.init_kv_cache(num_blocks)
        return cls(runner)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def copy_kv(self, source_blocks, target: "ModelTokens", target_blocks) -> None:
        # each layer's cache: [2, num_blocks, block_size, Hkv, D]
        for mine, theirs in zip(self.runner.kv_caches, target.runner.kv_caches):
            theirs[:, target_blocks] = mine[:, source_blocks]

    def forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
