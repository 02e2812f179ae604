"""Attention with PyTorch's SDPA over gathered blocks: runs on any device.

From a step's `StepMetadata` it builds its own plan once per step: the leading
sequences that compute a few tokens each are attended in groups of up to
DECODE_GROUP_SIZE sequences with as many query tokens (their blocks gathered into a
padded [B, L] copy, a boolean mask per group); each prompt chunk alone, causal inside
the chunk and attending to everything computed before it (gathered when there is
any).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.engine.attention import AttentionBackend, StepMetadata
from pdserve.engine.block_manager import blocks_for

# On CUDA, attention runs on FlashAttention, memory-efficient attention or the math
# fallback, never cuDNN's: PyTorch tries cuDNN first on H100 / H200, and cuDNN builds
# an execution graph for every new shape, which a serving engine makes every step. On
# an H200 that took 1.57 s of a 2,048-token prefill step of 1.67 s (22 ms on these;
# docs/gpu.md).
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Decodes are attended in groups of similar context length, so padding stays small
# (the runner orders them by context length).
DECODE_GROUP_SIZE = 32


@dataclass
class DecodeGroup:
    start: int  # first token of the group in the flat batch: B requests, S tokens each
    block_table: torch.Tensor  # [B, max_blocks] long
    # [B, 1, S * G, max_blocks * block_size] bool, True = attend (G query heads per KV
    # head; [B, 1, 1, L] when S == 1): query s of a request sees its KV up to itself.
    mask: torch.Tensor
    query_len: int = 1  # S

    @property
    def end(self) -> int:
        """One past its last token in the flat batch."""
        return self.start + self.block_table.shape[0] * self.query_len


@dataclass
class PrefillSegment:
    start: int  # first token of the chunk in the flat batch
    num_tokens: int  # query length
    context_len: int  # tokens computed before the chunk + the chunk
    block_ids: torch.Tensor  # [num_blocks] long


@dataclass
class TorchPlan:
    slot_mapping: torch.Tensor  # [T] long
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)


class TorchAttention(AttentionBackend):
    name = "torch"

    def build(self, step: StepMetadata) -> TorchPlan:
        device = step.slot_mapping.device
        lens, qlens, tables = step.seq_lens_host, step.query_lens, step.block_ids
        groups: list[DecodeGroup] = []
        i, token = 0, 0
        while i < step.num_decodes:  # runs of equal query length, DECODE_GROUP_SIZE at most
            n, j = qlens[i], i + 1
            while j < step.num_decodes and qlens[j] == n and j - i < DECODE_GROUP_SIZE:
                j += 1
            groups.append(self._group(token, lens[i:j], tables[i:j], n, device))
            token += (j - i) * n
            i = j
        prefills = []
        for b in range(step.num_decodes, step.num_seqs):
            prefills.append(PrefillSegment(token, qlens[b], lens[b],
                                           torch.tensor(tables[b], device=device)))
            token += qlens[b]
        return TorchPlan(step.slot_mapping, groups, prefills)

    def _group(self, first: int, contexts: list[int], tables: list[list[int]],
               query_len: int, device: torch.device) -> DecodeGroup:
        """Sequences computing `query_len` tokens each (their tokens from `first` in
        the flat batch): each one's context length (its KV including the tokens it
        computes) and block ids."""
        bs = self.block_size
        width = blocks_for(max(contexts), bs)
        table = [blocks[:width] + [0] * (width - len(blocks[:width])) for blocks in tables]
        lens = _tensor(contexts, device)  # [B]
        keys = torch.arange(width * bs, device=device)
        if query_len == 1:
            mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        else:  # query j sees the keys up to its own position
            ends = lens.unsqueeze(1) - query_len + 1 + torch.arange(
                query_len, device=device).unsqueeze(0)  # [B, S]
            mask = keys[None, None, :] < ends[:, :, None]  # [B, S, L]
            g = self.num_heads // self.num_kv_heads
            mask = mask[:, :, None, :].expand(-1, -1, g, -1).reshape(
                len(contexts), 1, query_len * g, -1)
        return DecodeGroup(first, _tensor(table, device), mask, query_len)

    def forward(self, q, k, v, kv_cache, meta: TorchPlan):
        # q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        assert q.shape[0] == k.shape[0] == meta.slot_mapping.shape[0]
        with sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else nullcontext():
            return self._forward(q, k, v, kv_cache, meta)

    def _forward(self, q, k, v, kv_cache, meta: TorchPlan):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.start:group.end] = self._decode(q[group.start:group.end], k_cache,
                                                      v_cache, group)
        for seg in meta.prefills:
            end = seg.start + seg.num_tokens
            out[seg.start:end] = self._prefill(q[seg.start:end], k[seg.start:end],
                                               v[seg.start:end], k_cache, v_cache, seg)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup):
        # q: [B * S, H, D]. A KV head's G query heads at each of the S positions ride
        # the query-length axis, [B, Hkv, S * G, D], so K/V ([B, Hkv, L, D]) are never
        # expanded to H heads.
        b, s, hkv, d = group.block_table.shape[0], group.query_len, self.num_kv_heads, self.head_dim
        assert q.shape[0] == b * s
        keys = self._gather(k_cache, group.block_table).view(b, -1, hkv, d)
        values = self._gather(v_cache, group.block_table).view(b, -1, hkv, d)
        q = q.view(b, s, hkv, -1, d).transpose(1, 2).reshape(b, hkv, -1, d)
        out = F.scaled_dot_product_attention(
            q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask,
            scale=self.scale)
        # [B, Hkv, S * G, D] -> [B * S, H, D]
        return out.view(b, hkv, s, -1, d).transpose(1, 2).reshape(b * s, self.num_heads, d)

    def _prefill(self, q, k, v, k_cache, v_cache, seg: PrefillSegment):
        # q: [S, H, D]; the chunk's own k, v: [S, Hkv, D]
        if seg.context_len == seg.num_tokens:
            mask, causal = None, True  # nothing before the chunk: plain causal
        else:
            shape = (-1, self.num_kv_heads, self.head_dim)
            k = self._gather(k_cache, seg.block_ids).view(shape)[:seg.context_len]
            v = self._gather(v_cache, seg.block_ids).view(shape)[:seg.context_len]
            offset = seg.context_len - seg.num_tokens
            rows = torch.arange(seg.num_tokens, device=q.device).unsqueeze(1)
            cols = torch.arange(seg.context_len, device=q.device).unsqueeze(0)
            mask, causal = cols <= rows + offset, False  # causal, aligned bottom-right
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
            scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # cache: [num_blocks, block_size, Hkv, D]; index_select over a flat id list is
        # several times faster on CPU than advanced indexing with a 2-D table.
        return cache.index_select(0, block_ids.reshape(-1))


def _tensor(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
