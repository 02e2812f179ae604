"""Preallocated paged KV tensors, one per layer: [2 (k, v), num_blocks, block_size, Hkv, D].

Per-layer tensors keep a layer's blocks contiguous, so kv_transfer can gather and send
one layer while the next is still being computed.
"""
from __future__ import annotations

import os

import torch

from engine.model_config import ModelConfig

CPU_DEFAULT_BYTES = 2 << 30


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.kv_size * elem


def num_blocks_for_budget(model: ModelConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    n = budget_bytes // bytes_per_block(model, block_size, dtype)
    if n < 1:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no block "
                         f"({bytes_per_block(model, block_size, dtype)} bytes each)")
    return n


def default_budget_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = total * (1 - gpu_memory_utilization)
        return int(max(free - reserved, 0))
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return min(CPU_DEFAULT_BYTES, available // 4)


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    # Zeroed: padded slots of a decode gather are masked, and 0 * NaN would not be.
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]
