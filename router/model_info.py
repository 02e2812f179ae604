"""What the router knows of the served model."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_bytes_per_block: int = 0  # one block's KV, all layers (the latency model's transfers)
