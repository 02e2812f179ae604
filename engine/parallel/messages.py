"""What rank 0 of a tensor-parallel worker broadcasts to its other ranks, in order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdserve.engine.scheduler_output import KVCopies
from pdserve.engine.step_buffers import StepInputs


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int  # as rank 0's block manager counts them (its scratch block apart)
    num_host_blocks: int = 0  # host memory's (the swap area and the prefix tier)


@dataclass(frozen=True)
class CopyKV:
    """A step's copies between device and host KV blocks, each rank its own shard's,
    before the step's Forward."""
    copies: KVCopies


@dataclass(frozen=True)
class RankExport:
    """A request whose prompt this step finishes, as one rank other than 0 sends its
    KV heads to one rank of the decode worker (a route, kv_transfer/heads.py): layer
    by layer, as its forward pass writes them."""
    request_id: str
    src_rank: int
    receiver_address: str  # the receiving rank's KV rendezvous
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_cached_blocks: int
    src_heads: tuple[int, int] | None  # this rank's KV heads sent (None: all, to all)
    dst_heads: tuple[int, int] | None


@dataclass(frozen=True)
class StepExport:
    """What a step exports (the prefill role's answer to its schedule): rank 0's
    per-layer hook, and what each other rank sends in the same forward pass."""
    send: Callable[[int], None] | None = None
    ranks: tuple[RankExport, ...] = ()


@dataclass(frozen=True)
class Forward:
    """One forward pass: every rank computes its shard of it over the same inputs."""
    step: StepInputs
    exports: tuple[RankExport, ...] = ()  # the KV the other ranks send as they compute


@dataclass(frozen=True)
class Shutdown:
    pass


RankMessage = InitKVCache | CopyKV | Forward | Shutdown
