"""A pair's data stream: one FIFO of payloads, sender -> receiver, no tags.

Both implementations match a send to a receive by issue order alone, which is NCCL's
rule; protocol.py says how both sides know that order before a byte moves.

    GlooData  a 2-rank gloo group of its own (CPU tensors; CUDA caches are staged
              through pinned host memory by the sender and receiver). Its own group
              is its own TCP connection: on the control group's, the next STEP or
              BEGIN would queue behind the payloads before it.
    NcclData  a 2-rank NCCL communicator of the pair (CUDA tensors, GPU to GPU); its
              sends go out on the caller's current stream's order, so a send issued
              on a side stream after a CUDA event waits for that event on the GPU,
              never on the host

A Work completes when its bytes moved; `done(work)` asks without blocking, `wait`
blocks up to a deadline. A stream that times out is closed with its pair: the pair is
re-created on the next transfer, so only the transfers in flight fail.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from pdserve.kv_transfer.protocol import DATA_TAG

_POLL_S = 0.0005


class GlooData:
    backend = "gloo"

    def __init__(self, store: dist.Store, rank: int, peer: int,
                 options: dist.ProcessGroupGloo._Options):
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("data/", store), rank, 2, options)
        self._peer = peer
        self.device = torch.device("cpu")

    def send(self, tensor: torch.Tensor):
        return self._pg.send([tensor], self._peer, DATA_TAG)

    def post_recv(self, tensor: torch.Tensor):
        return self._pg.recv([tensor], self._peer, DATA_TAG)

    def done(self, work) -> bool:
        # A gloo send or receive Work reports completion only once waited: until then
        # this says False, and a buffer goes back to its pool when the transfer settles.
        return work.is_completed()

    def wait(self, work, timeout_s: float | None = None) -> None:
        """Once per Work: a second wait on a completed gloo Work waits for the next
        message instead."""
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))

    def close(self) -> None:
        pg, self._pg = self._pg, None  # let go: its threads and socket end with it
        try:
            if pg is not None:
                pg.shutdown()
        except Exception:  # already broken by a lost peer
            pass


class NcclData:
    backend = "nccl"

    def __init__(self, store: dist.Store, rank: int, peer: int, device: torch.device):
        # The watchdog must never fire: its default handling tears the process down.
        # Deadlines are kept above this layer, which aborts the communicator instead.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(days=365)
        self._pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, options)
        self._peer = peer
        self.device = device
        self._closed = False

    def send(self, tensor: torch.Tensor):
        return self._pg.send([tensor], self._peer, 0)

    def post_recv(self, tensor: torch.Tensor):
        return self._pg.recv([tensor], self._peer, 0)

    def done(self, work) -> bool:
        return work.is_completed()

    def wait(self, work, timeout_s: float | None = None) -> None:
        """NCCL's own wait only orders streams; this one returns when the bytes moved.
        Polled: it runs on a transfer's own thread, never on the engine's."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not work.is_completed():
            if self._closed:
                raise ConnectionError("the pair's NCCL communicator was aborted")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("NCCL transfer timed out")
            time.sleep(_POLL_S)

    def close(self) -> None:
        self._closed = True
        try:
            self._pg.abort()  # fails what is in flight on this pair, and only that
        except Exception:
            pass
