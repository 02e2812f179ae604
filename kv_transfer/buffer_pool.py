"""Reusable uint8 message buffers, keyed by (device, size). Fresh multi-MB buffers
page-fault in on every transfer; pooled ones are already mapped. Bounded, thread-safe."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch


class BufferPool:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = defaultdict(list)
        self._held = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get((device, nbytes))
            if free:
                self._held -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        with self._lock:
            if self._held + nbytes <= self.max_bytes:
                self._free[buffer.device, nbytes].append(buffer)
                self._held += nbytes
