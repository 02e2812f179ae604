"""Transfer settings, frozen and validated where built."""
from __future__ import annotations

from dataclasses import dataclass, field

# The data stream's backends (backend.py chooses among them).
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class TransferConfig:
    timeout_s: float = 30.0  # from BEGIN: a transfer not complete by then fails on both sides
    connect_timeout_s: float = 30.0  # store connection and pair rendezvous
    # The data stream's (backend.py): auto = NCCL between distinct GPUs, else gloo
    # (CUDA caches staged through pinned host memory); "gloo" or "nccl" to force one.
    backend: str = "auto"
    # Leases on the decode side (held KV is released when one expires): reserved blocks
    # whose transfer has not begun, and landed KV whose request was never started.
    # The router bounds its prefill queues so that no admitted request waits this long.
    begin_lease_s: float = 120.0
    start_lease_s: float = 30.0
    # Receives a receiver keeps posted ahead on each pair's data stream (receive_window.py):
    # a step's payloads up to this many bytes are posted when its STEP arrives.
    receive_window_bytes: int = 64 << 20
    # Names the key space of every receiver's rendezvous store: only workers of the
    # same cluster (launch makes one per cluster) can read it or pair. "" = none.
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "begin_lease_s", "start_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.receive_window_bytes > 0:
            raise ValueError("receive_window_bytes must be > 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
