"""One pair's process group: rank 0 the receiver, rank 1 the sender.

Created lazily per (sender, receiver) over a prefix of the receiver's TCPStore, so
workers join and leave without anyone else re-initializing. gloo moves the bytes;
CUDA tensors are staged through host memory, which is how two workers sharing one
GPU, or on distinct GPUs, exchange KV. (NCCL would move them GPU to GPU, but it
matches sends to receives by issue order and ignores tags, and interleaved transfers
on one pair are told apart by tag here; see config.BACKENDS.)
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
# surfaces at once as a closed connection. gloo's context keeps the timeout it was
# built with for every later op (set_timeout does not reach it), so the group is built
# with this one; the rendezvous stays bounded by the store's own timeout.
_IDLE = datetime.timedelta(days=365)


class PairChannel:
    def __init__(self, store: dist.Store, pair: str, rank: int, host: str):
        """`host`: the address this side's gloo connections bind to (its node's)."""
        self.pair = pair
        self.peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        prefixed = dist.PrefixStore(f"pair/{pair}/", store)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _IDLE
        self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, options)
        self._send_lock = threading.Lock()

    @property
    def wire_device(self) -> torch.device:
        return torch.device("cpu")

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
