"""Decode steps replayed from CUDA graphs.

A decode-only step of B sequences runs padded to the smallest capture size >= B
(vLLM's sizes: 1, 2, 4, then every 8 up to max_num_seqs, at most 512). The padding
rows decode token 0 at position 0 in the runner's scratch block, a KV block no request
owns, so every step of one size launches the same kernels over the same buffers (the
runner's StepBuffers, whose addresses do not move once captured). The model's forward
over them is captured once per size at start-up, largest first, in one memory pool;
the real rows' logits, sampling, the KV export hook (a step with one runs eagerly) and
everything that syncs with the host stay outside the graphs.

Only a backend whose launches depend on the step's sizes alone can be captured (the
Triton kernel's grid is the padded batch); TorchAttention groups sequences on the
host, so with it every step runs eagerly. `enforce_eager` (vLLM's name) turns graphs
off. Without CUDA the same padded path runs eagerly (capture=False): tests hold it
exact on CPU."""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes to capture: 1, 2, 4, then every 8, up to max_num_seqs
    (0: unbounded) and MAX_CAPTURE_SIZE, the largest always included."""
    top = min(max_num_seqs or MAX_CAPTURE_SIZE, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else [*sizes, top]


class DecodeGraphs:
    def __init__(self, sizes: list[int], capture: bool):
        self.sizes = sorted(sizes)
        self.capture = capture
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.capture_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        """The smallest capture size that holds n sequences; None past the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture_all(self, fill: Callable[[int], object],
                    forward: Callable[[object], torch.Tensor], device: torch.device) -> None:
        """fill(size): the buffers filled for a step of that size (all padding, here),
        uploads included, before capture: only forward(filled), the model's hidden
        states over them, is captured (a copy from host staging captured with it would
        replay the capture's bytes). Each size runs once outside capture first (Triton
        compiles, cuBLAS picks its kernels)."""
        if not self.capture:
            return
        self._graphs.clear()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        began = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # the largest first: the pool fits the rest
            filled = fill(size)
            forward(filled)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(filled)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - began
        self.capture_bytes = max(free_before - torch.cuda.mem_get_info(device)[0], 0)
        log.info("captured %d CUDA graphs of decode steps (batch %d to %d) in %.1f s, "
                 "%.0f MiB", len(self.sizes), self.sizes[0], self.sizes[-1], self.capture_s,
                 self.capture_bytes / (1 << 20))

    def run(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The hidden states of a step of `size` rows, the buffers filled: replayed
        where captured, else forward() run eagerly."""
        captured = self._graphs.get(size)
        if captured is None:
            return forward()
        graph, out = captured
        graph.replay()
        return out
