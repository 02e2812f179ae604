"""Preallocated paged KV tensors, one per layer: [2 (k, v), num_blocks, block_size, Hkv, D].

Per-layer tensors keep a layer's blocks contiguous, so kv_transfer can gather and send
one layer while the next is still being computed.
"""
from __future__ import annotations

import os

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig

CPU_DEFAULT_BYTES = 2 << 30


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.kv_size * elem


def num_blocks_for_budget(model: ModelConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int, extra_bytes_per_block: int = 0) -> int:
    """extra_bytes_per_block: what else each block costs (a draft model's KV there)."""
    each = bytes_per_block(model, block_size, dtype) + extra_bytes_per_block
    n = budget_bytes // each
    if n < 1:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no block "
                         f"({each} bytes each)")
    return n


def default_budget_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """One rank's KV budget when none is given (kv_cache_memory_bytes, like vLLM's,
    is per device). CUDA: the share of the device that gpu_memory_utilization allows,
    less what is already allocated (weights) and a reserve for one step's
    activations. CPU: a fixed default, at most a quarter of available memory, split
    among the ranks of a tensor-parallel worker (they share the host)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device)
        budget = total * config.gpu_memory_utilization - used - _activation_reserve(config, model)
        if budget <= 0:
            raise ValueError("no device memory left for the KV cache; lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
        return int(budget)
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    # A tensor-parallel worker's ranks share the host: each takes its share.
    return min(CPU_DEFAULT_BYTES, available // 4) // config.tensor_parallel_size


def _activation_reserve(config: EngineConfig, model: ModelConfig) -> int:
    # A step's live activations: hidden states, the qkv and MLP intermediates of one
    # layer, and float32 logits for up to max_num_seqs rows, doubled for the
    # allocator's slack.
    tokens = config.scheduler.max_num_batched_tokens
    width = 3 * model.hidden_size + model.q_size + 2 * model.kv_size + 3 * model.intermediate_size
    logits = max(config.scheduler.max_num_seqs, 256) * model.vocab_size * 4
    return 2 * (tokens * width * 4 + logits)


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Each (source, destination) block's KV copied, in every layer (copy-on-write of
    a block shared by the choices of one prompt)."""
    device = kv_caches[0].device
    sources = torch.tensor([s for s, _ in pairs], device=device)
    targets = torch.tensor([d for _, d in pairs], device=device)
    for layer in kv_caches:
        layer.index_copy_(1, targets, layer.index_select(1, sources))


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    # Zeroed: padded slots of a decode gather are masked, and 0 * NaN would not be.
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]
