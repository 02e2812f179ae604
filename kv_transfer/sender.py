"""The prefill side: opens pairs lazily and streams a request's KV layer by layer.

    handle = sender.begin(request_id, receiver_address, src_blocks, dst_blocks, cached)
    ... forward pass: after layer i writes its KV, sender.send_layer(handle, i) ...
    sender.finish(handle)        # every layer landed on the receiver, or a typed error

send_layer gathers the request's scattered blocks of one layer into one contiguous
buffer and queues it asynchronously, so computing layer i+1 overlaps sending layer i.
Blocks the receiver already holds (its prefix hit) are never sent. How the gather
reaches the wire depends on the pair's data stream (backend.py):
    CPU cache, gloo   gathered into a pooled host buffer, sent at once
    CUDA cache, nccl  gathered on a side stream that waits for the compute stream;
                      the NCCL send is issued on that stream, so it follows the
                      gather on the GPU and the engine thread never waits
    CUDA cache, gloo  gathered and copied to pinned host memory on the side stream;
                      the stager (staging.py) sends it once the copy's event fired
"""
from __future__ import annotations

import datetime
import json
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pdserve.kv_transfer import backend as B
from pdserve.kv_transfer import protocol as P
from pdserve.kv_transfer import rendezvous
from pdserve.kv_transfer.buffer_pool import BufferPool
from pdserve.kv_transfer.channel import SENDER_RANK, PairChannel
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    PeerLostError,
    TransferAborted,
    TransferRefused,
    TransferTimeout,
)
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.staging import HostStager

_STATUS_ERRORS = {P.REFUSED: TransferRefused, P.ABORTED: TransferAborted,
                  P.TIMED_OUT: TransferTimeout}


@dataclass
class _Peer:
    store: dist.Store
    channel: PairChannel


@dataclass
class SendHandle:
    request_id: str
    peer: _Peer
    seq: int
    src_index: torch.Tensor  # the sender's blocks to send, in the receiver's order
    started: float
    status: torch.Tensor  # int64[1], filled by the receiver's one reply
    status_work: object  # its posted receive
    layers_sent: int = 0
    bytes_sent: int = 0
    # In-flight sends as _Inflight. A Work owns its tensor until it completes; pooled
    # buffers then go back to the pool.
    inflight: list = field(default_factory=list)
    closed: bool = False
    aborted: bool = False
    # send_layer (engine thread) and abort (another thread) take turns: an ABORT goes
    # out after every layer announced, never between an announcement and its payload.
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Inflight:
    """One send: its Works (or a Future of them, while staged) and the pooled buffers
    they read, which return to the pool once the Works completed."""
    works: object  # tuple of (Work, data plane or None), or a Future of one
    buffers: tuple = ()

    def _resolved(self, timeout_s: float | None):
        works = self.works
        return works.result(timeout_s) if isinstance(works, Future) else works

    def done(self) -> bool:
        if isinstance(self.works, Future):
            if not self.works.done():
                return False
            if self.works.exception() is not None:
                return True  # never sent: nothing reads the buffers
        return all(plane.done(w) if plane else w.is_completed()
                   for w, plane in self._resolved(0))

    def wait(self, deadline: float) -> None:
        for work, plane in self._resolved(max(deadline - time.monotonic(), 0.001)):
            if plane is None:
                work.wait(_remaining(deadline))
            else:
                plane.wait(work, max(deadline - time.monotonic(), 0.001))


class KVSender:
    def __init__(self, sender_id: str, kv_caches: list[torch.Tensor],
                 config: TransferConfig = TransferConfig(), host: str = "127.0.0.1"):
        """`host`: the address this side's pair connections bind to (its node's)."""
        self.sender_id = sender_id
        self.host = host
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self._layout_dict = self.layout.to_dict()
        self.config = config
        self.device = kv_caches[0].device
        self._incarnation = uuid.uuid4().hex[:8]
        self._connections = 0
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._device_id = B.DeviceId.of(self.device)
        # Layer messages, reused once sent; host ones pinned when they stage a GPU's.
        self._pool = BufferPool(pin=self.device.type == "cuda")
        self._stager = HostStager(f"kv-stager-{sender_id}") if self._stream is not None else None

    def begin(self, request_id: str, receiver_address: str, src_block_ids: list[int],
              dst_block_ids: list[int], num_cached_blocks: int = 0,
              connect: bool = True) -> SendHandle:
        """Handshake for one request. `src_block_ids` / `dst_block_ids` cover the whole
        request on each side; the first `num_cached_blocks` are held by the receiver
        already and are skipped. connect=False: a pair not open already is a
        PeerLostError rather than a rendezvous on the caller's thread."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"request {request_id}: {len(src_block_ids)} source blocks but "
                             f"{len(dst_block_ids)} destination blocks")
        if not 0 <= num_cached_blocks <= len(src_block_ids):
            raise ValueError(f"request {request_id}: num_cached_blocks out of range")
        peer = self._peers.get(receiver_address) if not connect else self._peer(receiver_address)
        if peer is None:
            raise PeerLostError(request_id, f"no open pair with {receiver_address}")
        with self._lock:
            self._seq += 1
            seq = self._seq
        hs = P.Handshake(request_id, list(dst_block_ids[num_cached_blocks:]), num_cached_blocks,
                         self._layout_dict)
        status = torch.full((1,), -1, dtype=torch.int64)
        try:
            status_work = peer.channel.post_recv(status, P.ack_tag(seq))
        except Exception as exc:
            self._drop_peer(peer)
            raise PeerLostError(request_id, f"receiver lost: {exc}") from None
        handle = SendHandle(request_id, peer, seq,
                            torch.tensor(src_block_ids[num_cached_blocks:], device=self.device),
                            time.monotonic(), status, status_work)
        self._send(handle, P.begin_messages(seq, hs))
        return handle

    def send_layer(self, handle: SendHandle, layer: int) -> None:
        with handle.lock:
            if handle.closed or handle.aborted:
                return
            self._send_layer(handle, layer)

    def _send_layer(self, handle: SendHandle, layer: int) -> None:
        if layer != handle.layers_sent:
            raise ValueError(f"request {handle.request_id}: layer {layer} sent out of order "
                             f"(expected {handle.layers_sent})")
        handle.layers_sent += 1
        self._recycle(handle)
        cache = self.kv_caches[layer]
        channel = handle.peer.channel
        nbytes = len(handle.src_index) * self.layout.block_bytes_per_layer
        announcement = P.layer_message(handle.seq, layer, nbytes)
        try:
            if self._stream is None:  # a CPU cache: gather straight into the message
                message = self._pool.get(nbytes, self.device)

                def gathered() -> torch.Tensor:
                    torch.index_select(cache, 1, handle.src_index,
                                       out=self._blocks(message, nbytes, cache))
                    return message[:nbytes]
                works = channel.send_announced(announcement, gathered)
                inflight = _Inflight(self._with_planes(works, channel), (message,))
            else:
                inflight = self._send_from_gpu(handle, channel, cache, announcement, nbytes)
        except Exception as exc:
            self._drop_peer(handle.peer)
            self._close(handle)
            raise PeerLostError(handle.request_id, f"send failed: {exc}") from None
        handle.bytes_sent += nbytes
        handle.inflight.append(inflight)

    def _send_from_gpu(self, handle: SendHandle, channel: PairChannel, cache: torch.Tensor,
                       announcement: torch.Tensor, nbytes: int) -> _Inflight:
        """Gather on the side stream once the compute stream wrote this layer; no host
        synchronize on the caller's (the engine's) thread."""
        scratch = self._pool.get(nbytes, self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            torch.index_select(cache, 1, handle.src_index, out=self._blocks(scratch, nbytes, cache))
            if channel.data.device.type == "cuda":  # NCCL: issued in this stream's order
                works = channel.send_announced(announcement, lambda: scratch[:nbytes])
                return _Inflight(self._with_planes(works, channel), (scratch,))
            host = self._pool.get(nbytes, channel.data.device)
            host[:nbytes].copy_(scratch[:nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        staged = self._stager.submit(copied, lambda: self._with_planes(
            channel.send_announced(announcement, lambda: host[:nbytes]), channel))
        return _Inflight(staged, (scratch, host))

    @staticmethod
    def _blocks(message: torch.Tensor, nbytes: int, cache: torch.Tensor) -> torch.Tensor:
        """The first nbytes of a pooled message, as a layer's [2, n, block, Hkv, D]."""
        return message[:nbytes].view(cache.dtype).view(2, -1, *cache.shape[2:])

    @staticmethod
    def _with_planes(works: tuple, channel: PairChannel) -> tuple:
        control, data = works
        return (control, None), (data, channel.data)

    def finish(self, handle: SendHandle, timeout: float | None = None) -> SendHandle:
        """Wait until the receiver confirms every layer landed; typed error otherwise."""
        if handle.layers_sent != self.layout.num_layers:
            raise ValueError(f"request {handle.request_id}: finish() after "
                             f"{handle.layers_sent}/{self.layout.num_layers} layers")
        deadline = handle.started + (self.config.timeout_s if timeout is None else timeout)
        try:
            try:
                self._settle(handle, deadline)
                handle.status_work.wait(_remaining(deadline))
            except Exception as exc:
                if not _is_timeout(exc):
                    raise
                self._drop_peer(handle.peer)  # a timed-out gloo op closes the pair
                raise TransferTimeout(handle.request_id, "the receiver did not confirm "
                                      "within the timeout") from None
            status = int(handle.status[0])
            message = "" if status == P.OK else self._reason(handle)
        except KVTransferError:
            self._close(handle)
            raise
        except Exception as exc:
            self._drop_peer(handle.peer)
            self._close(handle)
            raise PeerLostError(handle.request_id, f"receiver lost: {exc}") from None
        self._close(handle)
        if status != P.OK:
            raise _STATUS_ERRORS.get(status, KVTransferError)(handle.request_id, message)
        return handle

    def abort(self, handle: SendHandle) -> None:
        """Give up on a transfer: the receiver releases its blocks; buffers are dropped."""
        with handle.lock:
            if handle.closed or handle.aborted:
                return
            handle.aborted = True
            # Only announced layers were posted on the receiver: one ABORT ends the
            # transfer there, after them.
            if handle.layers_sent < self.layout.num_layers:
                try:
                    self._send(handle, [P.abort_message(handle.seq)])
                except Exception:
                    return  # the pair is gone: the receiver's side fails on its own
        try:
            deadline = time.monotonic() + self.config.timeout_s
            self._settle(handle, deadline)
            handle.status_work.wait(_remaining(deadline))  # owed even for an abort
        except Exception:
            self._drop_peer(handle.peer)  # the receiver's side fails on its own
        self._close(handle)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            peer.channel.close()
        self._peers.clear()
        if self._stager is not None:
            self._stager.close()

    # ---- internals ----------------------------------------------------------------

    def _send(self, handle: SendHandle, messages: list[torch.Tensor]) -> None:
        """Control messages (BEGIN, ABORT)."""
        try:
            works = handle.peer.channel.send(messages)
            handle.inflight.extend(_Inflight(((w, None),)) for w in works)
        except Exception as exc:
            self._drop_peer(handle.peer)
            self._close(handle)
            raise PeerLostError(handle.request_id, f"send failed: {exc}") from None

    def _reason(self, handle: SendHandle) -> str:
        key = P.reason_key(handle.peer.channel.pair, handle.seq)
        message = handle.peer.store.get(key).decode()
        handle.peer.store.delete_key(key)
        return message

    def _settle(self, handle: SendHandle, deadline: float) -> None:
        """Wait for in-flight sends: a Work owns its tensor, and dropping it early
        would free bytes still being sent."""
        for inflight in handle.inflight:
            inflight.wait(deadline)
        self._recycle(handle)

    def _recycle(self, handle: SendHandle) -> None:
        """Sent buffers go back to the pool; in-flight ones stay with their Work."""
        still = []
        for inflight in handle.inflight:
            if not inflight.done():
                still.append(inflight)
                continue
            for buffer in inflight.buffers:
                self._pool.put(buffer)
        handle.inflight = still

    def _close(self, handle: SendHandle) -> None:
        # Only after the sends settled, or once the pair is dropped (nothing in flight).
        handle.closed = True
        handle.inflight.clear()

    def connect(self, address: str) -> None:
        """Open the pair ahead of the first transfer (the rendezvous takes about a
        second; better at start-up than inside a prefill step)."""
        self._peer(address)

    def is_connected(self, address: str) -> bool:
        return address in self._peers

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            with self._connect_lock:  # one pair per receiver, whoever asks first
                peer = self._peers.get(address)
                if peer is None:
                    peer = self._peers[address] = self._connect(address)
        return peer

    def _connect(self, address: str) -> _Peer:
        host, port = address.rsplit(":", 1)
        timeout_s = self.config.connect_timeout_s
        try:
            store = rendezvous.scoped(rendezvous.connect(host, int(port), timeout_s),
                                      self.config.secret)
            known = store.check([P.LAYOUT_KEY, P.DEVICE_KEY])
            theirs = KVLayout(**json.loads(store.get(P.LAYOUT_KEY))) if known else None
            device = B.DeviceId.decode(store.get(P.DEVICE_KEY)) if known else None
        except Exception as exc:
            raise PeerLostError(None, f"cannot reach receiver at {address}: {exc}") from None
        if theirs is None:
            raise PeerLostError(None, f"the receiver at {address} is not of this cluster "
                                "(its rendezvous has no layout and device under our secret)")
        diffs = self.layout.differences(theirs)
        if diffs:
            raise LayoutMismatchError(None, f"receiver at {address} has another KV layout: "
                                      + "; ".join(diffs))
        try:
            backend = B.choose(self.config.backend, self._device_id, device)
        except ValueError as exc:
            raise LayoutMismatchError(None, f"receiver at {address}: {exc}") from None
        self._connections += 1  # a reconnect must not meet the old pair's store keys
        pair = f"{self.sender_id}-{self._incarnation}-{self._connections}"
        index = store.add(P.JOIN_COUNTER, 1)
        store.set(P.join_key(index), P.JoinRecord(
            self.sender_id, pair, backend, P.join_proof(self.config.secret, pair)).encode())
        try:
            channel = PairChannel(store, pair, SENDER_RANK, self.host, backend, self.device,
                                  timeout_s)
        except Exception as exc:
            raise PeerLostError(None, f"pair rendezvous with {address} failed: {exc}") from None
        return _Peer(store, channel)

    def _drop_peer(self, peer: _Peer) -> None:
        for address, known in list(self._peers.items()):
            if known is peer:
                del self._peers[address]
                peer.channel.close()


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _is_timeout(exc: Exception) -> bool:
    """gloo says so in its message; a staged send's Future or NCCL's poll raise
    TimeoutError (the Future's with no message at all)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text
