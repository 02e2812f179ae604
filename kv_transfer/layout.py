"""What both sides must agree on before a byte moves."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> "KVLayout":
        # kv_caches[i]: [2, num_blocks, block_size, Hkv, D], one per layer
        shape = kv_caches[0].shape
        assert len(shape) == 5 and shape[0] == 2, f"unexpected KV cache shape {tuple(shape)}"
        return cls(len(kv_caches), shape[2], shape[3], shape[4],
                   str(kv_caches[0].dtype).removeprefix("torch."))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def differences(self, other: "KVLayout") -> list[str]:
        return [f"{f.name}: {getattr(self, f.name)} here vs {getattr(other, f.name)} there"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_dict(self) -> dict:
        return asdict(self)
