"""Reusable uint8 message buffers in size classes, bounded, thread-safe.

Fresh multi-MB buffers page-fault in on every transfer (and pinned ones cost a
cudaHostAlloc); pooled ones are already mapped. Prompts vary in length, so a pool
keyed on exact sizes would fill with buffers that are never asked for again: here a
request is rounded up to its size class (four classes per power of two, so at most
25% of a buffer goes unused) and any buffer of that class serves it. `get` returns
the class's buffer; the caller uses its first `nbytes`. At most `max_bytes` sit idle
in the pool; a buffer put back beyond that is freed.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

MIN_CLASS = 4 << 10
STEPS_PER_DOUBLING = 4


def size_class(nbytes: int) -> int:
    """The smallest class >= nbytes: MIN_CLASS, then 2^k * (1 + i/4) for i in 0..3."""
    if nbytes <= MIN_CLASS:
        return MIN_CLASS
    power = 1 << (nbytes - 1).bit_length() - 1  # the largest power of two < nbytes
    step = power // STEPS_PER_DOUBLING
    return power + -(-(nbytes - power) // step) * step


class BufferPool:
    def __init__(self, max_bytes: int = 1 << 30, pin: bool = False):
        """pin: host buffers are page-locked, so copies to and from a GPU run
        asynchronously (only where CUDA is available)."""
        self.max_bytes = max_bytes
        self.pin = pin
        self.hits = self.misses = 0
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = defaultdict(list)
        self._idle = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get((device, size))
            if free:
                self._idle -= size
                self.hits += 1
                return free.pop()
            self.misses += 1
        pin = self.pin and device.type == "cpu"
        return torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)

    def put(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        if size != size_class(size):
            raise ValueError(f"a buffer of {size} bytes did not come from this pool")
        with self._lock:
            if self._idle + size <= self.max_bytes:
                self._free[buffer.device, size].append(buffer)
                self._idle += size
