"""What rank 0 of a tensor-parallel worker broadcasts to its other ranks, in order."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.step_buffers import StepInputs


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int  # as rank 0's block manager counts them (its scratch block apart)


@dataclass(frozen=True)
class Forward:
    """One forward pass: every rank computes its shard of it over the same inputs."""
    step: StepInputs


@dataclass(frozen=True)
class Shutdown:
    pass


RankMessage = InitKVCache | Forward | Shutdown
