"""Transfer settings, frozen and validated where built."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class TransferConfig:
    timeout_s: float = 30.0  # a transfer not complete by then fails on both sides
    connect_timeout_s: float = 30.0  # store connection and pair rendezvous
    backend: str = "auto"  # auto: gloo for CPU caches or one shared GPU, nccl across GPUs

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if not self.connect_timeout_s > 0:
            raise ValueError("connect_timeout_s must be > 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
