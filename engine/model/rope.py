"""Rotary position embeddings, computed exactly as HF transformers does (float32)."""
from __future__ import annotations

import math

import torch

from pdserve.engine.model_config import ModelConfig, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_len, looked up per token."""

    def __init__(self, config: ModelConfig, max_len: int, device, dtype: torch.dtype):
        inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_len, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq)  # [max_len, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> "RotaryTables":
        """The batch's cos/sin rows, looked up once and shared by every layer."""
        return RotaryTables(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class RotaryTables:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [T, 1, D]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin as HF computes it, bit for bit (a - b * s is
        a + (-b) * s exactly), without building rotate_half(x): one new tensor of x's
        size and two of half of it, where HF's form makes four and a half.
        x: [T, heads, D], a view is fine."""
        half = x.shape[-1] // 2
        out = x * self.cos
        out[..., :half] -= x[..., half:] * self.sin[..., :half]
        out[..., half:] += x[..., :half] * self.sin[..., half:]
        return out
