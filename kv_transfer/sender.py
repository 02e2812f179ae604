"""The prefill side: opens pairs lazily and streams a request's KV layer by layer.

    handle = sender.begin(request_id, receiver_address, src_blocks, dst_blocks, cached)
    ... forward pass: after layer i writes its KV, sender.send_layer(handle, i) ...
    sender.finish(handle)        # every layer landed on the receiver, or a typed error

send_layer gathers the request's scattered blocks of one layer into one contiguous
buffer and queues it asynchronously, so computing layer i+1 overlaps sending layer i.
Blocks the receiver already holds (its prefix hit) are never sent.
"""
from __future__ import annotations

import datetime
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pdserve.kv_transfer import protocol as P
from pdserve.kv_transfer import rendezvous
from pdserve.kv_transfer.buffer_pool import BufferPool
from pdserve.kv_transfer.channel import CONTROL_TAG, SENDER_RANK, PairChannel
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
    # In-flight sends as (Work, pooled buffer or None). A Work owns its tensor until it
    # completes; pooled buffers then go back to the pool.
    inflight: list = field(default_factory=list)
    closed: bool = False
    aborted: bool = False
    # send_layer (engine thread) and abort (another thread) take turns: an abort pads
    # exactly the layers not sent, so the pair sees one message per layer.
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        self._pool = BufferPool()  # layer messages, reused once sent

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
        cache = self.kv_caches[layer]
        wire = handle.peer.channel.wire_device
        message, data = self._layer_message(handle, P.LAYER_DATA, wire)
        gathered = data.view(cache.dtype).view(2, len(handle.src_index), *cache.shape[2:])
        if self._stream is None:
            torch.index_select(cache, 1, handle.src_index, out=gathered)  # [2, n, block, Hkv, D]
        else:
            # Gather on a side stream once the compute stream has written this layer;
            # for gloo the gathered blocks then move to host memory in one copy.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                if wire == cache.device:
                    torch.index_select(cache, 1, handle.src_index, out=gathered)
                else:
                    gathered.copy_(cache.index_select(1, handle.src_index))
            self._stream.synchronize()
        handle.bytes_sent += data.numel()
        handle.layers_sent += 1
        self._recycle(handle)
        self._send(handle, [message], P.data_tag(handle.seq), pooled=message)

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
            # The receiver posted a receive for every layer: pad the rest with scratch
            # whose trailer says "aborted"; the first one ends the transfer there.
            missing = self.layout.num_layers - handle.layers_sent
            try:
                if missing:
                    scratch, _ = self._layer_message(handle, P.LAYER_ABORT,
                                                     handle.peer.channel.wire_device)
                    self._send(handle, [scratch] * missing, P.data_tag(handle.seq))
            except Exception:
                self._close(handle)
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

    # ---- internals ----------------------------------------------------------------

    def _send(self, handle: SendHandle, messages: list[torch.Tensor],
              tag: int = CONTROL_TAG, pooled: torch.Tensor | None = None) -> None:
        try:
            works = handle.peer.channel.send(messages, tag)
            handle.inflight.extend((w, pooled) for w in works)
        except Exception as exc:
            self._drop_peer(handle.peer)
            self._close(handle)
            raise PeerLostError(handle.request_id, f"send failed: {exc}") from None

    def _layer_message(self, handle: SendHandle, mark: int, device: torch.device):
        """A uint8 message of one layer's data plus its trailer; returns (message, data)."""
        nbytes = len(handle.src_index) * self.layout.block_bytes_per_layer
        message = self._pool.get(nbytes + P.TRAILER_BYTES, device)
        message[nbytes:] = torch.tensor([mark], dtype=torch.int64).view(torch.uint8)
        return message, message[:nbytes]

    def _reason(self, handle: SendHandle) -> str:
        key = P.reason_key(handle.peer.channel.pair, handle.seq)
        message = handle.peer.store.get(key).decode()
        handle.peer.store.delete_key(key)
        return message

    def _settle(self, handle: SendHandle, deadline: float) -> None:
        """Wait for in-flight sends: a Work owns its tensor, and dropping it early
        would free bytes gloo is still sending."""
        for work, _ in handle.inflight:
            work.wait(_remaining(deadline))
        self._recycle(handle)

    def _recycle(self, handle: SendHandle) -> None:
        """Sent buffers go back to the pool; in-flight ones stay with their Work."""
        still = []
        for work, buffer in handle.inflight:
            if not work.is_completed():
                still.append((work, buffer))
            elif buffer is not None:
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
            known = store.check([P.LAYOUT_KEY])
            theirs = KVLayout(**json.loads(store.get(P.LAYOUT_KEY))) if known else None
        except Exception as exc:
            raise PeerLostError(None, f"cannot reach receiver at {address}: {exc}") from None
        if theirs is None:
            raise PeerLostError(None, f"the receiver at {address} is not of this cluster "
                                "(its rendezvous has no layout under our secret)")
        diffs = self.layout.differences(theirs)
        if diffs:
            raise LayoutMismatchError(None, f"receiver at {address} has another KV layout: "
                                      + "; ".join(diffs))
        self._connections += 1  # a reconnect must not meet the old pair's store keys
        pair = f"{self.sender_id}-{self._incarnation}-{self._connections}"
        index = store.add(P.JOIN_COUNTER, 1)
        store.set(P.join_key(index), P.JoinRecord(
            self.sender_id, pair, "gloo", P.join_proof(self.config.secret, pair)).encode())
        try:
            channel = PairChannel(store, pair, SENDER_RANK, self.host)
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
    return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
