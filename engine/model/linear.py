"""The model's matmuls: on a CPU, oneDNN over weights packed once at load.

PyTorch's float32 `F.linear` on a CPU runs MKL's sgemm, which on this project's AMD
EPYC machines reaches 170-220 GFLOP/s on two cores; oneDNN's kernel over a weight
reordered once into its blocked layout reaches 445-475 GFLOP/s at the same shapes
(decode batches of 1-256 rows, 2,048-token prefill chunks), in float32 still (its
error against float64 is of MKL's order). vLLM's CPU backend does the same on x86
(`dispatch_cpu_unquantized_gemm`: oneDNN with the weight prepacked, the dense copy
dropped). Elsewhere (CUDA, other dtypes, CPUs other than x86-64, where it was never
measured, a build without oneDNN or with it disabled) it is `F.linear`.

oneDNN builds a primitive per input row count; a step's row counts vary, and at
varied counts (1-2,048 in random order) it still ran at 430-470 GFLOP/s here.
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn


def packs(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on `device` in `dtype` run packed here (else `F.linear`)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where `F.linear` serves."""
    if not packs(weight.device, weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` (the same parameters, so checkpoints load into it as into one) whose
    `pack()`, called once its weight is loaded, moves it to the packed layout. Packed,
    it is for inference where it stands: its weight parameter is empty (state_dict
    has none to give) and the packed copy is no parameter, so `.to()` leaves it."""
    packed: torch.Tensor | None = None

    def pack(self) -> None:
        if self.packed is not None:
            return  # packed already: its dense weight is gone
        self.packed = pack(self.weight)
        if self.packed is not None:
            # Only the packed copy is read from now on; the dense one would double
            # the weights' memory (as vLLM, which drops it too).
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
