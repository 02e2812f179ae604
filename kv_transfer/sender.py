"""The prefill side: opens pairs lazily and streams requests' KV layer by layer.

    handles = [sender.begin(request_id, receiver_address, src, dst, cached), ...]
    sender.announce(handles)     # before the forward pass: one STEP per receiver
    ... after layer i writes its KV, sender.send_layers(handles, i) ...
    sender.finish(handle)        # every layer landed on the receiver, or a typed error

A transfer on its own may skip announce and call send_layer(handle, i). Each layer
of a transfer is gathered from its scattered blocks into one contiguous buffer and
sent asynchronously, so computing layer i+1 overlaps sending layer i. Blocks the
receiver already holds (its prefix hit) are never sent. How the gather reaches the
wire depends on the pair's data stream (backend.py):
    CPU cache, gloo   gathered into a pooled host buffer, sent at once
    CUDA cache, nccl  gathered on a side stream that waits for the compute stream;
                      the NCCL send is issued on that stream, so it follows the
                      gather on the GPU and the engine thread never waits
    CUDA cache, gloo  gathered and copied to pinned host memory on the side stream;
                      the stager (staging.py) sends it once the copy's event fired
Every slot a STEP announced is sent, in its order (protocol.py): sends and aborts on
one pair take turns under the pair's lock, a transfer aborted mid-step has its
remaining slots padded, and a step left unfinished (its forward pass failed) is
padded out before the pair's next STEP.
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


@dataclass(eq=False)
class _Peer:
    store: dist.Store
    channel: PairChannel
    # Sends and aborts on this pair take turns: slots go out in their STEP's order.
    lock: threading.Lock = field(default_factory=threading.Lock)
    step: "_Step | None" = None  # the last one announced
    issued: int = 0  # sends issued on this pair, counted
    ranks: tuple = ()  # a tensor-parallel receiver's other ranks' rendezvous
    # (issue count, _Inflight) of sends tied to no one transfer: STEP messages and
    # padding. A Work owns its tensor until it completes; each is waited by the first
    # transfer on this pair to settle after it (by then it completed: both streams
    # are FIFOs), so waiting costs nothing.
    loose: list = field(default_factory=list)


@dataclass(eq=False)
class _Step:
    """The transfers one prefill step streams to one receiver, announced by one STEP:
    their payloads go layer-major, in this order."""
    members: list  # SendHandle
    nbytes: list  # per layer, each member's
    layers_sent: int = 0
    padded_out: bool = False  # every member ended; its remaining slots went as padding

    def unfinished(self, num_layers: int) -> bool:
        """Slots of it are still to go out, and a live member would send them."""
        return self.layers_sent < num_layers and any(h.live for h in self.members)


@dataclass(eq=False)
class SendHandle:
    request_id: str
    peer: _Peer
    seq: int
    src_index: torch.Tensor  # the sender's blocks to send, in the receiver's order
    started: float
    status: torch.Tensor  # int64[1], filled by the receiver's one reply
    status_work: object  # its posted receive
    step: _Step | None = None
    heads: tuple[int, int] | None = None  # the slice of local KV heads sent (None: all)
    block_bytes: int = 0  # one block of one layer, over those heads
    layers_sent: int = 0
    bytes_sent: int = 0
    last_issued: int = 0  # the pair's issue count at this transfer's last send
    # In-flight sends as _Inflight. A Work owns its tensor until it completes; pooled
    # buffers then go back to the pool.
    inflight: list = field(default_factory=list)
    closed: bool = False
    aborted: bool = False  # given up: no more of its layers go out
    settling: bool = False  # finish or abort claimed the wait for its sends

    @property
    def live(self) -> bool:
        """Its layers still go out: neither aborted nor closed (by a lost pair)."""
        return not (self.aborted or self.closed)


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
              connect: bool = True, heads: tuple[int, int] | None = None,
              dst_heads: tuple[int, int] | None = None) -> SendHandle:
        """Handshake for one request. `src_block_ids` / `dst_block_ids` cover the whole
        request on each side; the first `num_cached_blocks` are held by the receiver
        already and are skipped. connect=False: a pair not open already is a
        PeerLostError rather than a rendezvous on the caller's thread. heads /
        dst_heads: [start, end) of this cache's KV heads to send and where they go
        among the receiver's (tensor-parallel groups: kv_transfer/heads.py); None:
        every head, to every head."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"request {request_id}: {len(src_block_ids)} source blocks but "
                             f"{len(dst_block_ids)} destination blocks")
        if not 0 <= num_cached_blocks <= len(src_block_ids):
            raise ValueError(f"request {request_id}: num_cached_blocks out of range")
        layout = self._layout_dict
        if heads is not None or dst_heads is not None:
            heads = heads or (0, self.layout.num_kv_heads)
            dst_heads = dst_heads or heads
            if not (0 <= heads[0] < heads[1] <= self.layout.num_kv_heads
                    and dst_heads[1] - dst_heads[0] == heads[1] - heads[0]
                    and dst_heads[0] >= 0):
                raise ValueError(f"request {request_id}: KV heads {heads} -> {dst_heads} of "
                                 f"{self.layout.num_kv_heads}")
            layout = {**layout, "num_kv_heads": heads[1] - heads[0]}
            heads, dst_heads = tuple(heads), tuple(dst_heads)
        peer = self._peers.get(receiver_address) if not connect else self._peer(receiver_address)
        if peer is None:
            raise PeerLostError(request_id, f"no open pair with {receiver_address}")
        with self._lock:
            self._seq += 1
            seq = self._seq
        hs = P.Handshake(request_id, list(dst_block_ids[num_cached_blocks:]), num_cached_blocks,
                         layout, list(dst_heads) if dst_heads else None)
        status = torch.full((1,), -1, dtype=torch.int64)
        try:
            status_work = peer.channel.post_recv(status, P.ack_tag(seq))
        except Exception as exc:
            self._drop_peer(peer)
            raise PeerLostError(request_id, f"receiver lost: {exc}") from None
        handle = SendHandle(request_id, peer, seq,
                            torch.tensor(src_block_ids[num_cached_blocks:], device=self.device),
                            time.monotonic(), status, status_work, heads=heads,
                            block_bytes=KVLayout(**layout).block_bytes_per_layer)
        with peer.lock:
            try:
                handle.inflight.extend(self._control(peer, P.begin_messages(seq, hs)))
            except PeerLostError as exc:
                self._close(handle)
                raise PeerLostError(request_id, exc.message) from None
        return handle

    def announce(self, handles: list[SendHandle]) -> dict[str, KVTransferError]:
        """Announce the transfers one prefill step streams, before its forward pass:
        those bound for each receiver go in one STEP, so the receiver posts the
        step's receives now and every payload moves as soon as it is sent. A transfer
        announced, aborted or closed already is left out. Returns the failures by
        request id: a lost peer fails its own transfers, not the step."""
        failures: dict[str, KVTransferError] = {}
        by_peer: dict[int, list[SendHandle]] = {}
        for handle in handles:
            if handle.step is None and handle.live:
                by_peer.setdefault(id(handle.peer), []).append(handle)
        for members in by_peer.values():
            peer = members[0].peer
            with peer.lock:
                members = [h for h in members if h.live]  # aborted meanwhile?
                if not members:
                    continue
                step = _Step(members, [len(h.src_index) * h.block_bytes for h in members])
                try:
                    self._abandon(peer.step)
                    works = self._control(peer, P.step_messages(
                        [(h.seq, n) for h, n in zip(members, step.nbytes)]))
                except PeerLostError as exc:
                    self._lost(members, exc, failures)
                    continue
                peer.loose.extend((peer.issued, inflight) for inflight in works)
                peer.step = step
                for handle in members:
                    handle.step = step
        return failures

    def send_layers(self, handles: list[SendHandle], layer: int) -> dict[str, KVTransferError]:
        """Layer `layer` of every announced transfer in `handles` (whole steps: all of
        a step's members go, in its order; an aborted member's slot as padding).
        Returns the failures by request id, as announce does."""
        failures: dict[str, KVTransferError] = {}
        steps = dict.fromkeys(h.step for h in handles if h.step is not None)
        for step in steps:
            peer = step.members[0].peer
            with peer.lock:
                if step.padded_out:
                    continue  # every member ended; its slots went out already
                if layer != step.layers_sent:
                    raise ValueError(f"layer {layer} sent out of order (expected "
                                     f"{step.layers_sent})")
                step.layers_sent += 1
                try:
                    for handle, nbytes in zip(step.members, step.nbytes):
                        if not handle.live:
                            self._pad(peer, nbytes)
                            continue
                        handle.layers_sent += 1
                        self._recycle(handle)
                        cache = self.kv_caches[layer]
                        if handle.heads is not None:
                            cache = cache[:, :, :, handle.heads[0]:handle.heads[1]]
                        handle.inflight.append(self._send_slot(
                            peer, nbytes, cache, handle.src_index))
                        handle.last_issued = peer.issued
                        handle.bytes_sent += nbytes
                    if step.layers_sent == self.layout.num_layers:
                        self._step_sent(peer, step)
                except Exception as exc:
                    self._drop_peer(peer)
                    self._lost([h for h in step.members if h.live],
                               PeerLostError(None, f"send failed: {exc}"), failures)
        return failures

    def send_whole(self, handles: list[SendHandle]) -> dict[str, KVTransferError]:
        """KV already in the cache (a live migration's copies): announced as one step
        and every layer sent at once; the failures by request id, as announce's."""
        failures = self.announce(handles)
        for layer in range(self.layout.num_layers):
            failures.update(self.send_layers(handles, layer))
        return failures

    def _step_sent(self, peer: _Peer, step: _Step) -> None:
        """STEP_SENT, once a step's last slot went out: its members not aborted by now
        are whole (the receiver completes none before reading this)."""
        works = self._control(peer, [P.step_sent_message(len(step.members))])
        peer.loose.extend((peer.issued, inflight) for inflight in works)

    def send_layer(self, handle: SendHandle, layer: int) -> None:
        """One layer of a transfer streamed on its own (announced alone at layer 0);
        raises its failure."""
        if handle.step is None and layer == 0:
            open_step = handle.peer.step
            if open_step is not None and open_step.unfinished(self.layout.num_layers):
                # announce() would end that transfer: its step is the pair's slot order
                raise ValueError(f"request {handle.request_id}: another transfer is still "
                                 "streaming on this pair; transfers that interleave are "
                                 "announced together (announce, send_layers)")
            self._raise_for(handle, self.announce([handle]))
        if handle.step is None:
            if not handle.live:
                return
            raise ValueError(f"request {handle.request_id}: layer {layer} sent before layer 0")
        if handle.step.members != [handle]:
            raise ValueError(f"request {handle.request_id} was announced with other "
                             "transfers: send their layers together (send_layers)")
        self._raise_for(handle, self.send_layers([handle], layer))

    @staticmethod
    def _raise_for(handle: SendHandle, failures: dict[str, KVTransferError]) -> None:
        if handle.request_id in failures:
            raise failures[handle.request_id]

    def _send_slot(self, peer: _Peer, nbytes: int, cache: torch.Tensor | None = None,
                   index: torch.Tensor | None = None) -> _Inflight:
        """The next slot of the pair's data stream: blocks `index` of `cache`, gathered,
        or (no index) padding of nbytes. Under the pair's lock."""
        peer.issued += 1
        data = peer.channel.data
        if self._stream is None:  # a CPU cache: gather straight into the message
            message = self._pool.get(nbytes, self.device)
            if index is not None:
                torch.index_select(cache, 1, index, out=self._blocks(message, nbytes, cache))
            return _Inflight(((data.send(message[:nbytes]), data),), (message,))
        # A CUDA cache: gather on the side stream once the compute stream wrote this
        # layer; no host synchronize on the caller's (the engine's) thread.
        scratch = self._pool.get(nbytes, self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if index is not None:
                torch.index_select(cache, 1, index, out=self._blocks(scratch, nbytes, cache))
            if data.device.type == "cuda":  # NCCL: issued in this stream's order
                return _Inflight(((data.send(scratch[:nbytes]), data),), (scratch,))
            host = self._pool.get(nbytes, data.device)
            host[:nbytes].copy_(scratch[:nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        staged = self._stager.submit(copied, lambda: ((data.send(host[:nbytes]), data),))
        return _Inflight(staged, (scratch, host))

    def _pad(self, peer: _Peer, nbytes: int) -> None:
        """A slot whose transfer ended: bytes of no meaning, which the receiver drops."""
        inflight = self._send_slot(peer, nbytes)
        peer.loose.append((peer.issued, inflight))

    @staticmethod
    def _blocks(message: torch.Tensor, nbytes: int, cache: torch.Tensor) -> torch.Tensor:
        """The first nbytes of a pooled message, as a layer's [2, n, block, Hkv, D]."""
        return message[:nbytes].view(cache.dtype).view(2, -1, *cache.shape[2:])

    def finish(self, handle: SendHandle, timeout: float | None = None) -> SendHandle:
        """Wait until the receiver confirms every layer landed; typed error otherwise."""
        if handle.layers_sent != self.layout.num_layers:
            raise ValueError(f"request {handle.request_id}: finish() after "
                             f"{handle.layers_sent}/{self.layout.num_layers} layers")
        with handle.peer.lock:
            if handle.settling:
                raise ValueError(f"request {handle.request_id}: finished or aborted already")
            if handle.closed:  # its pair was lost under it
                raise PeerLostError(handle.request_id, "the pair with the receiver was lost")
            handle.settling = True
        deadline = handle.started + (self.config.timeout_s if timeout is None else timeout)
        try:
            try:
                self._settle(handle, deadline)
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
        peer = handle.peer
        with peer.lock:
            if handle.closed or handle.settling:
                return
            handle.settling = True
            try:
                self._end(handle)
            except PeerLostError:
                self._close(handle)  # the pair is gone: the receiver's side fails on its own
                return
        try:
            self._settle(handle, time.monotonic() + self.config.timeout_s)  # a status is owed
        except Exception:
            self._drop_peer(peer)  # the receiver's side fails on its own
        self._close(handle)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            peer.channel.close()
        self._peers.clear()
        if self._stager is not None:
            self._stager.close()

    # ---- internals ----------------------------------------------------------------

    def _end(self, handle: SendHandle) -> None:
        """Under the pair's lock: no more of the transfer's layers go out. The receiver
        hears an ABORT (after every slot sent so far); a step whose members all ended
        has its remaining slots padded now, since nobody else will send them."""
        handle.aborted = True
        if handle.layers_sent == self.layout.num_layers:
            return  # all of it went out: the receiver's status says how it ended
        handle.inflight.extend(self._control(handle.peer, [P.abort_message(handle.seq)]))
        handle.last_issued = handle.peer.issued
        step = handle.step
        if step is not None and not step.padded_out and not any(m.live for m in step.members):
            try:
                for _ in range(step.layers_sent, self.layout.num_layers):
                    for nbytes in step.nbytes:
                        self._pad(handle.peer, nbytes)
            except Exception as exc:
                self._drop_peer(handle.peer)
                raise PeerLostError(handle.request_id, f"send failed: {exc}") from None
            step.layers_sent, step.padded_out = self.layout.num_layers, True
            self._step_sent(handle.peer, step)

    def _abandon(self, step: _Step | None) -> None:
        """Under the pair's lock, before its next STEP: a step left unfinished (its
        forward pass failed before the last layer) ends every member still running,
        so its remaining slots go out as padding."""
        if step is None or not step.unfinished(self.layout.num_layers):
            return
        for handle in step.members:
            if handle.live:
                self._end(handle)

    def _control(self, peer: _Peer, messages: list[torch.Tensor]) -> list[_Inflight]:
        """Control messages (STEP, ABORT), under the pair's lock; a failure drops the pair."""
        try:
            works = peer.channel.send(messages)
        except Exception as exc:
            self._drop_peer(peer)
            raise PeerLostError(None, f"send failed: {exc}") from None
        peer.issued += 1
        return [_Inflight(((w, None),)) for w in works]

    def _lost(self, handles: list[SendHandle], exc: KVTransferError,
              failures: dict[str, KVTransferError]) -> None:
        for handle in handles:
            self._close(handle)
            failures[handle.request_id] = type(exc)(handle.request_id, exc.message)

    def _reason(self, handle: SendHandle) -> str:
        key = P.reason_key(handle.peer.channel.pair, handle.seq)
        message = handle.peer.store.get(key).decode()
        handle.peer.store.delete_key(key)
        return message

    def _settle(self, handle: SendHandle, deadline: float) -> None:
        """Wait for the transfer's sends (a Work owns its tensor, and dropping it early
        would free bytes still being sent), then for its status, then reap the pair's
        loose sends issued before its last: complete by then, as both streams are
        FIFOs and the receiver took this transfer's STEP and slots."""
        for inflight in handle.inflight:
            inflight.wait(deadline)
        self._recycle(handle)
        handle.status_work.wait(_remaining(deadline))
        peer = handle.peer
        with peer.lock:
            reaped = [i for n, i in peer.loose if n <= handle.last_issued]
            peer.loose = [(n, i) for n, i in peer.loose if n > handle.last_issued]
        for inflight in reaped:
            inflight.wait(deadline)
            for buffer in inflight.buffers:
                self._pool.put(buffer)

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
        # Its step's members point back at it: the edge goes, so a step and its
        # transfers are freed (their Works with them) without waiting for a collection.
        handle.closed = True
        handle.inflight.clear()
        handle.step = None

    def connect(self, address: str, any_heads: bool = False) -> None:
        """Open the pair ahead of the first transfer (the rendezvous takes about a
        second; better at start-up than inside a prefill step). any_heads: the two
        caches may hold different numbers of KV heads (ranks of tensor-parallel
        workers: each transfer then names the heads it carries); a receiver that
        publishes its other ranks is taken so anyway."""
        self._peer(address, any_heads)

    def is_connected(self, address: str) -> bool:
        return address in self._peers

    def ranks_of(self, address: str) -> list[str]:
        """The other ranks' rendezvous of the tensor-parallel receiver at `address`
        (rank 1 first; [] for one of one rank), as its store said when paired."""
        return list(self._peer(address).ranks)

    @property
    def receivers(self) -> list[str]:
        """The addresses of the receivers it holds a pair with."""
        return list(self._peers)

    def disconnect(self, address: str) -> bool:
        """Closes the pair with that receiver (it left, or stopped receiving): its
        connections, process groups and their threads go, and the receiver's side,
        seeing the connection close, ends its own. A transfer still on it fails as a
        lost peer. False if no pair with it was open."""
        peer = self._peers.get(address)
        if peer is None:
            return False
        self._drop_peer(peer)
        return True

    def _peer(self, address: str, any_heads: bool = False) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            with self._connect_lock:  # one pair per receiver, whoever asks first
                peer = self._peers.get(address)
                if peer is None:
                    peer = self._peers[address] = self._connect(address, any_heads)
        return peer

    def _connect(self, address: str, any_heads: bool = False) -> _Peer:
        host, port = address.rsplit(":", 1)
        timeout_s = self.config.connect_timeout_s
        try:
            store = rendezvous.scoped(rendezvous.connect(host, int(port), timeout_s),
                                      self.config.secret)
            known = store.check([P.LAYOUT_KEY, P.DEVICE_KEY])
            theirs = KVLayout(**json.loads(store.get(P.LAYOUT_KEY))) if known else None
            device = B.DeviceId.decode(store.get(P.DEVICE_KEY)) if known else None
            ranks = tuple(json.loads(store.get(P.RANKS_KEY))) \
                if known and store.check([P.RANKS_KEY]) else ()
        except Exception as exc:
            raise PeerLostError(None, f"cannot reach receiver at {address}: {exc}") from None
        if theirs is None:
            raise PeerLostError(None, f"the receiver at {address} is not of this cluster "
                                "(its rendezvous has no layout and device under our secret)")
        # The KV heads each side holds may differ between tensor-parallel ranks: each
        # transfer's handshake then says which it fills, and the receiver checks them.
        diffs = [d for d in self.layout.differences(theirs)
                 if not (d.startswith("num_kv_heads") and (any_heads or ranks))]
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
        return _Peer(store, channel, ranks=ranks)

    def _drop_peer(self, peer: _Peer) -> None:
        for address, known in list(self._peers.items()):
            if known is peer:
                del self._peers[address]
                peer.channel.close()
                # Its last step points back at it through its members: a cycle that
                # would keep their Works, and gloo's threads and sockets with them.
                peer.step, peer.loose = None, []


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _is_timeout(exc: Exception) -> bool:
    """gloo says so in its message; a staged send's Future or NCCL's poll raise
    TimeoutError (the Future's with no message at all)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text
