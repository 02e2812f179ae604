"""Host-memory KV blocks (the swap area and the prefix tier, engine/host_pool.py), one
tensor per layer: [num_host_blocks, 2 (k, v), block_size, Hkv, D], block-major so
that a run of host blocks is one contiguous range (one DMA on cuda). Pinned on cuda,
so copies to and from the device are asynchronous to the host.

Copies run in order on the device's current stream, before the step's forward pass:
every copy to host first (a swap-out, a block stored in the tier), then every copy to
the device (a swap-in, a prefix-tier hit loaded). On cpu they are index copies.
"""
from __future__ import annotations

import os
import time

import torch

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.scheduler_output import KVCopies

GIB = 1 << 30


def host_blocks_for(gib: float, bytes_per_block: int) -> int:
    return int(gib * GIB) // bytes_per_block


def check_host_memory(swap_space: float, kv_offloading_size: float, num_ranks: int) -> None:
    """Refuses host KV memory the host cannot give (every rank of a tensor-parallel
    worker takes its own on this host), naming the flag and what is free."""
    asked = (swap_space + kv_offloading_size) * num_ranks
    if not asked:
        return
    free = available_host_bytes() / GIB
    if asked > free:
        flag = "--swap-space" if swap_space >= kv_offloading_size else "--kv-offloading-size"
        raise ValueError(
            f"{flag}: host KV memory of {swap_space:g} GiB swap + {kv_offloading_size:g} "
            f"GiB offloading per device x {num_ranks} device(s) = {asked:g} GiB is more "
            f"than the {free:.1f} GiB of host memory free")


def available_host_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (free memory and the
    page cache it can drop, such as freshly read weights), else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class HostKVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        """model: this rank's (its shard's KV heads)."""
        self.device = device
        pin = device.type == "cuda"
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, pin_memory=pin)
                       for _ in range(model.num_layers)]

    def copy(self, kv_caches: list[torch.Tensor], copies: KVCopies) -> None:
        """The step's copies: to host, then to the device."""
        if copies.to_host:
            devices, hosts = zip(*copies.to_host)
            device_ids = torch.tensor(devices, device=self.device)
            for layer, host in zip(kv_caches, self.layers):
                gathered = layer.index_select(1, device_ids).transpose(0, 1)
                self._write_host(host, list(hosts), gathered)
        if copies.to_device:
            hosts, devices = zip(*copies.to_device)
            device_ids = torch.tensor(devices, device=self.device)
            for layer, host in zip(kv_caches, self.layers):
                blocks = self._read_host(host, list(hosts))  # [n, 2, ...] on the device
                layer.index_copy_(1, device_ids, blocks.transpose(0, 1))

    def _write_host(self, host: torch.Tensor, ids: list[int], blocks: torch.Tensor) -> None:
        if self.device.type == "cpu":
            host.index_copy_(0, torch.tensor(ids), blocks)
            return
        for start, end, first in _runs(ids):
            host[first:first + end - start].copy_(blocks[start:end], non_blocking=True)

    def _read_host(self, host: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if self.device.type == "cpu":
            return host.index_select(0, torch.tensor(ids))
        return torch.cat([host[first:first + end - start].to(self.device, non_blocking=True)
                          for start, end, first in _runs(ids)])

    def seconds_per_block(self, kv_caches: list[torch.Tensor],
                          num_blocks: int) -> tuple[float, float]:
        """One block's copy to host and back to the device, each measured over
        `num_blocks` distinct blocks (the least of three tries; their contents kept):
        the price of a swap (preemption_mode auto) and of a host-tier hit (the
        router's forecast)."""
        num = max(1, min(num_blocks, len(self.layers[0]), kv_caches[0].shape[1]))
        pairs = list(zip(range(num), range(num)))
        self.copy(kv_caches, KVCopies(to_host=pairs, to_device=pairs))  # setup, unmeasured
        return (min(self._timed(kv_caches, KVCopies(to_host=pairs)) for _ in range(3)) / num,
                min(self._timed(kv_caches, KVCopies(to_device=pairs)) for _ in range(3)) / num)

    def _timed(self, kv_caches: list[torch.Tensor], copies: KVCopies) -> float:
        began = time.perf_counter()
        self.copy(kv_caches, copies)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began


def _runs(ids: list[int]):
    """(start, end, first host id) of each run of consecutive host ids."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, i, ids[start]
            start = i
