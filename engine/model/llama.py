"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat token batch.

Weights follow HF names, with q/k/v fused into `qkv_proj` at load time (one matmul
instead of three). gate/up stay apart: the halves of a fused output are strided, and
the elementwise SwiGLU over strided halves costs more on CPU than the fusion saves.

Under tensor parallelism (engine/parallel/) the model is built from a rank's local
config (its heads, KV heads and intermediate size) and its Shard: o_proj and down_proj
sum their partial products over the group, the embedding and the logits are split by
vocabulary. A whole model (a Shard of size 1, no group) calls no collective.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend
from pdserve.engine.model.linear import Linear, linear, pack
from pdserve.engine.model.rope import RotaryEmbedding, RotaryTables
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.sharding import Shard

LayerHook = Callable[[int], None]  # called with the layer index once its KV is written


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalize in float32, cast back, then scale by the weight.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class RowParallel(Linear):
    """A Linear whose input is split over the group: partial products summed, the
    bias (rank 0's only) added before the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 group: TensorParallelGroup | None):
        super().__init__(in_features, out_features,
                         bias=bias and (group is None or group.rank == 0))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.group is None else self.group.all_reduce_(y)


class VocabEmbedding(nn.Embedding):
    """The embedding table's rows [first, first + rows) of the vocabulary: ids outside
    them look up zeros, and the group sums the ranks' lookups (exact: one term each)."""

    def __init__(self, shard: Shard, hidden_size: int, group: TensorParallelGroup | None):
        super().__init__(shard.vocab_rows, hidden_size)
        self.first = shard.first_vocab
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(input_ids)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.group.all_reduce_(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, group: TensorParallelGroup | None = None):
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                               bias=config.qkv_bias)
        self.o_proj = RowParallel(config.q_size, config.hidden_size, config.o_bias, group)

    def forward(self, x, rotary: RotaryTables, backend: AttentionBackend,
                kv_cache: torch.Tensor, meta: object) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        # q's and k's heads side by side, rotated in one go: [T, H + Hkv, D]
        qk = rotary.apply(qk.view(t, c.num_heads + c.num_kv_heads, c.head_dim))
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        return self.o_proj(backend.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, group: TensorParallelGroup | None = None):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = RowParallel(i, h, bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's act_fn(gate) * up, in place on the gate's output: two passes over it and
        # no new tensor (a fresh [T, intermediate] tensor is page-faulted in on CPU).
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, group: TensorParallelGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, group)

    def forward(self, x, rotary, backend, kv_cache, meta):
        # The residual added into each block's fresh output (x + y == y + x, bit for
        # bit), not into a third tensor.
        x = self.self_attn(self.input_layernorm(x), rotary, backend, kv_cache, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard | None = None,
                 group: TensorParallelGroup | None = None):
        """config: the model as this rank holds it (Shard.local_config at TP > 1)."""
        super().__init__()
        shard = shard or Shard.of(config)
        self.config = config
        self.group = group
        self.embed_tokens = VocabEmbedding(shard, config.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(config, group)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, shard.vocab_rows, bias=False))
        self.tied_packed: torch.Tensor | None = None  # the embedding's, for the logits

    def pack(self) -> None:
        """Once the weights are loaded: every matmul's weight to its packed layout
        (`linear.py`). Tied embeddings keep their dense table for the lookup and get
        a packed copy for the logits."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None:
            self.tied_packed = pack(self.embed_tokens.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                backend: AttentionBackend, kv_caches: list[torch.Tensor],
                meta: object, on_layer_done: LayerHook | None = None) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        x = self.embed_tokens(input_ids)
        rotary = rope.tables(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary, backend, kv_caches[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] -> float32 logits [N, vocab] (under tensor parallelism
        # rank 0's, gathered from each rank's vocabulary rows; None on the others)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.embed_tokens.weight, None, self.tied_packed)
        if self.group is not None:
            if not hidden.shape[0]:  # no row wanted (every rank knows): nothing to gather
                return logits.new_empty(0, self.config.vocab_size).float() \
                    if self.group.rank == 0 else None
            logits = self.group.gather_columns(logits, self.config.vocab_size)
            if logits is None:
                return None
        return logits.float()
