"""One pair's process group: rank 0 the receiver, rank 1 the sender.

Created lazily per (sender, receiver) over a prefix of the receiver's TCPStore, so
workers join and leave without anyone else re-initializing. gloo moves CPU tensors
(CUDA tensors are staged through host memory, which is how two workers sharing one
GPU exchange KV); NCCL moves CUDA tensors between distinct GPUs.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

RECEIVER_RANK, SENDER_RANK = 0, 1
CONTROL_TAG = 0  # the ordered stream of headers and handshakes
# An idle pair waits for its next header indefinitely: a gloo recv that times out
# closes the pair. Transfer deadlines are enforced above this layer; a dead peer
# surfaces at once as a closed connection.
_IDLE = datetime.timedelta(days=365)


class PairChannel:
    def __init__(self, store: dist.Store, pair: str, rank: int, backend: str,
                 device: torch.device, connect_timeout_s: float):
        self.pair = pair
        self.backend = backend
        self.device = device
        self.peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        prefixed = dist.PrefixStore(f"pair/{pair}/", store)
        connect = datetime.timedelta(seconds=connect_timeout_s)
        if backend == "nccl":
            self.pg = _nccl_group(prefixed, rank, device, connect)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, connect)
            self.pg.set_timeout(_IDLE)
        self._send_lock = threading.Lock()

    @property
    def wire_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def send(self, messages: list[torch.Tensor], tag: int = CONTROL_TAG) -> list:
        """Queue tensors in order on `tag`, atomically with respect to other senders on
        this pair; returns their Work handles (async: the caller keeps computing)."""
        with self._send_lock:
            return [self.pg.send([self._to_wire(t)], self.peer, tag) for t in messages]

    def recv(self, buffer: torch.Tensor, tag: int = CONTROL_TAG) -> None:
        """Blocking receive of the next message on `tag` into `buffer` (wire device)."""
        self.pg.recv([buffer], self.peer, tag).wait()

    def post_recv(self, buffer: torch.Tensor, tag: int):
        """Post a receive now, complete later: data flows without a round trip."""
        return self.pg.recv([buffer], self.peer, tag)

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wire_device) if t.device != self.wire_device else t

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # already broken by a lost peer
            pass


def _nccl_group(store, rank: int, device: torch.device, timeout):
    if not dist.is_nccl_available():
        raise RuntimeError("backend 'nccl' needs a CUDA build of torch with NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def device_descriptor(device: torch.device) -> dict:
    """What a peer needs to pick a backend: CPU, or which physical GPU."""
    import socket
    if device.type != "cuda":
        return {"host": socket.gethostname(), "kind": "cpu", "gpu": None}
    props = torch.cuda.get_device_properties(device)
    return {"host": socket.gethostname(), "kind": "cuda", "gpu": str(getattr(props, "uuid", device))}


def choose_backend(requested: str, mine: dict, theirs: dict) -> str:
    if requested != "auto":
        return requested
    distinct_gpus = (mine["kind"] == theirs["kind"] == "cuda"
                     and (mine["host"], mine["gpu"]) != (theirs["host"], theirs["gpu"]))
    return "nccl" if distinct_gpus else "gloo"
