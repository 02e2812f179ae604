"""The attention seam: one kernel-shaped description of a step's batch, and the
backends that attend over the paged KV cache from it.

A step's batch is flat: [T] tokens, sequence after sequence. The runner describes it
once per step in `StepMetadata`, the shape kernels take (vLLM's common attention
metadata): where each sequence's query tokens start, each one's length with them,
an int32 block table, the slot each new token's K/V goes to, and which leading
sequences compute a few tokens each (decodes, the rows of a speculative
verification, a draft model's short chunks) rather than a prompt chunk. Every
sequence follows one rule: its q_len query tokens are the last q_len of its seq_len
positions, and query i attends keys 0 .. seq_len - q_len + i.

Each `AttentionBackend` turns that into what it needs once per step (`build`), then
attends layer by layer (`forward`): `TorchAttention` (any device: gathers blocks and
masks for SDPA) and `TritonAttention` (a paged kernel reading blocks in place; CUDA,
or Triton's interpreter on CPU). `attention_backend` in the engine's config picks
one; unset, triton on CUDA and torch on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepMetadata:
    """One step's batch as kernels see it. The tensors are views of the runner's
    persistent buffers on the device (int32 where a kernel indexes with them); the
    host lists are the same figures, so a backend reads them without a device sync."""
    query_start_loc: torch.Tensor  # int32 [B + 1]: sequence b's queries are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # int32 [B]: its KV length, the query tokens included
    block_table: torch.Tensor  # int32 [B, max_blocks], 0-padded
    slot_mapping: torch.Tensor  # long [T]: the flat KV slot each token writes
    num_decodes: int  # the first num_decodes sequences compute a few tokens each
    num_decode_tokens: int  # their tokens, the batch's first
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]  # host copies, per sequence
    seq_lens_host: list[int]
    block_ids: list[list[int]]  # each sequence's block ids (its table row, unpadded)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend:
    """build(step) once per step, then forward(q, k, v, kv_cache, built) per layer:
    q [T, H, D], k and v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D];
    forward writes the tokens' K/V into the cache at step.slot_mapping and returns
    [T, H * D]."""
    name = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def build(self, step: StepMetadata) -> object:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta) -> torch.Tensor:
        raise NotImplementedError


def resolve(name: str | None, device: torch.device) -> str:
    """The backend `attention_backend` names, or the default for the device; refuses
    triton where it cannot run."""
    if name is None:
        return "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "triton":
        if not _triton_importable():
            raise ValueError("attention_backend triton needs the triton package "
                             "(pip install triton); use --attention-backend torch")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend triton runs on cuda (on cpu only under "
                             "TRITON_INTERPRET=1, slowly); use --attention-backend torch")
    return name


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int) -> AttentionBackend:
    """The backend `resolve` chose."""
    if name == "triton":
        from pdserve.engine.triton_attention import TritonAttention
        return TritonAttention(num_heads, num_kv_heads, head_dim, block_size)
    from pdserve.engine.torch_attention import TorchAttention
    return TorchAttention(num_heads, num_kv_heads, head_dim, block_size)


def _triton_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None
