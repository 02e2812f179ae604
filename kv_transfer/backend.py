"""Which transport a pair's data stream uses, from the devices of its two KV caches.

    nccl  both caches on CUDA, on distinct GPUs: GPU to GPU, no host copy
    gloo  anything else: CPU caches directly; CUDA caches staged through pinned host
          memory (two workers sharing one GPU cannot form an NCCL communicator)

`auto` picks by that rule; `gloo` forces host staging; `nccl` is refused where it
cannot work. A GPU is named by its UUID, so two processes that each see their GPU as
cuda:0 are still told apart.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from pdserve.kv_transfer.config import BACKENDS


@dataclass(frozen=True)
class DeviceId:
    type: str  # "cpu" | "cuda"
    uuid: str = ""  # the GPU's, for CUDA

    @classmethod
    def of(cls, device: torch.device) -> "DeviceId":
        if device.type != "cuda":
            return cls(device.type)
        return cls("cuda", str(torch.cuda.get_device_properties(device).uuid))

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "DeviceId":
        fields = json.loads(raw)
        return cls(str(fields["type"]), str(fields.get("uuid", "")))


def choose(requested: str, sender: DeviceId, receiver: DeviceId) -> str:
    """The data stream's backend, or ValueError naming why `requested` cannot be."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {requested!r}")
    nccl_ok = sender.type == receiver.type == "cuda" and sender.uuid != receiver.uuid
    if requested == "nccl" and not nccl_ok:
        why = ("both KV caches must be on CUDA" if "cpu" in (sender.type, receiver.type)
               else "both KV caches are on the same GPU")
        raise ValueError(f"backend 'nccl' cannot carry this pair: {why}; use 'auto' or 'gloo'")
    if requested == "auto":
        return "nccl" if nccl_ok else "gloo"
    return requested
