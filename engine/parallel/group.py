"""One tensor-parallel worker's ranks, joined: the collectives the sharded model calls,
and the step rank 0 broadcasts to the others.

Two process groups over one store, built directly (no default group, so the same
process also holds kv_transfer's pairs): a gloo group for control (the step's
description, CPU bytes), and the device group for the model's collectives (NCCL on
CUDA; on CPU the gloo group itself).

A step's description goes out in one broadcast of a fixed CHUNK-byte buffer (a second
one only for the rest of a description longer than that), so the other ranks learn
the whole step at once: no per-layer round-trip through Python or Ray."""
from __future__ import annotations

import datetime
import pickle
import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK = 32 << 10
_HEADER = struct.Struct("<Q")
# A rank waits for rank 0's next step for as long as the worker is idle; a lost peer
# surfaces at once as a closed connection. gloo keeps the timeout a group is built
# with for every later op, so the groups are built with this one (kv_transfer's
# pairs do the same); the rendezvous is bounded by the store's own timeout.
_IDLE = datetime.timedelta(days=365)


@dataclass
class CommStats:
    """What the collectives moved since the group was joined (benchmarks read it)."""
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    gathers: int = 0
    gather_bytes: int = 0
    broadcasts: int = 0
    broadcast_bytes: int = 0
    broadcast_s: float = 0.0  # rank 0: describing and sending its steps (the send
    # waits for the other ranks to post their receive, i.e. to finish the last step)
    pack_s: float = 0.0  # of which describing them (pickling into the chunk)


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, control: dist.ProcessGroup,
                 device_group: dist.ProcessGroup, device: torch.device):
        self.rank = rank
        self.size = size
        self.device = device
        self._control = control
        self._device_group = device_group
        self._chunk = torch.zeros(CHUNK, dtype=torch.uint8)
        self.stats = CommStats()

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, host: str,
             device: torch.device) -> "TensorParallelGroup":
        """Blocks until all `size` ranks joined over `store` (bounded by its timeout).
        `host`: the address this rank's gloo connections bind to."""
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _IDLE
        control = dist.ProcessGroupGloo(dist.PrefixStore("tp/control/", store), rank, size,
                                        options)
        device_group = control
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = _IDLE  # the watchdog would tear the process down
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("tp/nccl/", store), rank,
                                                 size, nccl)
        return cls(rank, size, control, device_group, device)

    # ---- the model's collectives --------------------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; every rank gets the same values."""
        self._device_group.allreduce([x]).wait()
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """Rank 0: every rank's x [N, cols] side by side, cut to `width` columns; the
        others send theirs and get None."""
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._device_group.gather(outputs, [x.contiguous()], options).wait()
        self.stats.gathers += 1
        self.stats.gather_bytes += x.numel() * x.element_size()
        return torch.cat(outputs[0], dim=-1)[:, :width] if self.rank == 0 else None

    # ---- rank 0's steps -------------------------------------------------------------

    def broadcast(self, message: object) -> None:
        """Rank 0: `message` to every other rank."""
        began = time.perf_counter()
        data, head = self.pack(message)
        self.stats.pack_s += time.perf_counter() - began
        self._broadcast(self._chunk)
        if head > CHUNK:
            self._broadcast(torch.frombuffer(bytearray(data[CHUNK - _HEADER.size:]),
                                             dtype=torch.uint8))
        self.stats.broadcasts += 1
        self.stats.broadcast_bytes += head
        self.stats.broadcast_s += time.perf_counter() - began

    def pack(self, message: object) -> tuple[bytes, int]:
        """`message` pickled, its length and first CHUNK bytes in the chunk buffer;
        returns the pickle and the bytes it takes with its header."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = _HEADER.size + len(data)
        first = min(head, CHUNK)
        view = self._chunk.numpy()
        _HEADER.pack_into(view, 0, len(data))
        view[_HEADER.size:first] = memoryview(data)[:first - _HEADER.size]
        return data, head

    def receive(self) -> object:
        """A rank > 0: rank 0's next message (waits while the worker is idle)."""
        self._broadcast(self._chunk)
        view = self._chunk.numpy()
        (length,) = _HEADER.unpack_from(view, 0)
        first = min(_HEADER.size + length, CHUNK)
        data = view[_HEADER.size:first].tobytes()
        if _HEADER.size + length > CHUNK:
            rest = torch.empty(_HEADER.size + length - CHUNK, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._control.broadcast([buffer], options).wait()

    def close(self) -> None:
        """Its groups shut down now (threads and sockets end), not at collection; a
        peer's pending collective fails. Idempotent."""
        groups = [g for g in {id(g): g for g in (self._device_group, self._control)}.values()
                  if g is not None]
        self._control = self._device_group = None
        for group in groups:
            try:
                group.shutdown()
            except Exception:  # already broken by a lost peer
                pass
