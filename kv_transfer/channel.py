"""One pair: rank 0 the receiver, rank 1 the sender.

Created lazily per (sender, receiver) over a prefix of the receiver's TCPStore, so
workers join and leave without anyone else re-initializing. A 2-rank gloo group
carries the control stream and the status replies (small CPU messages, told apart by
tag); the data stream is `data` (data_plane.py): a gloo group of its own, or an NCCL
communicator of the pair. Both sides exchange one message on the data
stream before the pair is used, so an NCCL communicator is created here, on the
connecting thread, and never inside a prefill step.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from pdserve.kv_transfer.data_plane import GlooData, NcclData
from pdserve.kv_transfer.protocol import CONTROL_TAG

RECEIVER_RANK, SENDER_RANK = 0, 1
# An idle pair waits for its next header indefinitely: a gloo recv that times out
# closes the pair. Transfer deadlines are enforced above this layer; a dead peer
# surfaces at once as a closed connection. gloo's context keeps the timeout it was
# built with for every later op (set_timeout does not reach it), so the group is built
# with this one; the rendezvous stays bounded by the store's own timeout.
_IDLE = datetime.timedelta(days=365)


class PairChannel:
    def __init__(self, store: dist.Store, pair: str, rank: int, host: str,
                 backend: str = "gloo", device: torch.device = torch.device("cpu"),
                 ready_timeout_s: float = 30.0):
        """`host`: the address this side's gloo connections bind to (its node's);
        `device`: this side's KV cache device (the NCCL stream's)."""
        self.pair = pair
        self.peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        prefixed = dist.PrefixStore(f"pair/{pair}/", store)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _IDLE
        self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, options)
        self._send_lock = threading.Lock()
        try:
            if backend == "nccl":
                self.data = NcclData(prefixed, rank, self.peer, device)
            elif backend == "gloo":
                self.data = GlooData(prefixed, rank, self.peer, options)
            else:
                raise ValueError(f"unknown data backend {backend!r}")
            self._ready(rank, ready_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        return self.data.backend

    def _ready(self, rank: int, timeout_s: float) -> None:
        probe = torch.ones(1, dtype=torch.uint8, device=self.data.device)
        work = self.data.send(probe) if rank == SENDER_RANK else self.data.post_recv(probe)
        self.data.wait(work, timeout_s)

    def send(self, messages: list[torch.Tensor], tag: int = CONTROL_TAG) -> list:
        """Queue control messages in order on `tag`, atomically with respect to other
        senders on this pair; returns their Work handles (async)."""
        with self._send_lock:
            return [self.pg.send([t], self.peer, tag) for t in messages]

    def post_recv(self, buffer: torch.Tensor, tag: int = CONTROL_TAG):
        """Post a control receive now, complete later."""
        return self.pg.recv([buffer], self.peer, tag)

    def close(self) -> None:
        """Ends the pair: its process groups shut down and are let go here, so their
        threads and sockets end now, not when a collector finds the transfers that
        still point at this channel. Any later call on it raises."""
        data = getattr(self, "data", None)
        if data is not None:
            data.close()
            self.data = None
        pg = getattr(self, "pg", None)
        self.pg = None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already broken by a lost peer
                pass
