"""The decode side: publishes a rendezvous address, accepts pairs, scatters layers.

A transfer's life, each stage under a lease (TransferConfig):
    expect() (blocks reserved)        -> BEGIN within begin_lease_s
    BEGIN validated and claimed       -> every layer landed within timeout_s (its
                                         receives are posted when its STEP arrives)
    landed (status OK)                -> the owner watches it (landed() / wait())
                                         within start_lease_s
A refusal, an abort (either side), an expired lease or a lost peer ends it instead:
`on_release(request_id)` hands the reserved blocks back to their owner and waiters get
a typed error. A BEGIN always gets exactly one status reply: the claim of a reservation
and every ending take the transfer's lock, so they cannot interleave.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import hmac
import json
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.kv_transfer import backend as B
from pdserve.kv_transfer import protocol as P
from pdserve.kv_transfer import rendezvous
from pdserve.kv_transfer.buffer_pool import BufferPool
from pdserve.kv_transfer.channel import RECEIVER_RANK, PairChannel
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.errors import (
    KVTransferError,
    PeerLostError,
    TransferAborted,
    TransferRefused,
    TransferTimeout,
)
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.receive_window import ReceiveWindow, Slot

_POLL_S = 0.05


LEASES = ("begin", "transfer", "start")

log = logging.getLogger(__name__)


@dataclass
class _Incoming:
    request_id: str
    block_ids: list[int]  # to fill, in order
    num_cached_blocks: int
    lease: str | None  # the stage whose lease runs (LEASES); None: the owner watches
    expires: float  # monotonic end of that lease
    pair: str | None = None
    seq: int | None = None
    index: torch.Tensor | None = None  # block_ids on the cache's device
    watched: bool = True  # its owner watches it once landed (else forgotten then)
    # Tensor-parallel senders (kv_transfer/heads.py): a request's KV heads may come as
    # parts, one per sending rank, each a transfer of its own over its pair. A part
    # has its `parent` (the request) and `heads`; the request, the heads no part
    # claimed yet, and its parts. A request claimed whole has no parts.
    heads: tuple[int, int] | None = None
    parent: "_Incoming | None" = None
    unclaimed: set = field(default_factory=set)
    parts: list = field(default_factory=list)
    stepped: bool = False  # a STEP announced its payloads
    whole: bool = False  # its step's STEP_SENT came with no ABORT before it
    layers_landed: int = 0
    settled: bool = False  # claimed under `lock` by the one path that ends it
    landed: bool = False  # settled by landing whole
    # Held across each scatter: once a failure releases the blocks to their owner,
    # no late layer may write into them.
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: Future = field(default_factory=Future)  # None, or the typed error


class KVReceiver:
    def __init__(self, kv_caches: list[torch.Tensor], config: TransferConfig = TransferConfig(),
                 host: str = "127.0.0.1",
                 on_release: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.config = config
        self.on_release = on_release
        self._clock = clock  # leases and deadlines read it (tests pass a fake)
        self.device = kv_caches[0].device
        self.host = host
        self._server = rendezvous.serve(host, config.connect_timeout_s)
        self.address = f"{host}:{self._server.port}"
        self.store = rendezvous.scoped(self._server, config.secret)
        self.store.set(P.LAYOUT_KEY, json.dumps(self.layout.to_dict()))
        self.store.set(P.DEVICE_KEY, B.DeviceId.of(self.device).encode())
        self.bytes_received = 0
        self.lease_expiries = dict.fromkeys(LEASES, 0)
        # Layer receive buffers, reused once scattered; pinned where they stage a GPU's.
        self._staging = BufferPool(pin=self.device.type == "cuda")
        # The largest payload a STEP may announce: every block of one layer.
        self._max_payload = kv_caches[0].shape[1] * self.layout.block_bytes_per_layer
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._copies: list = []  # (CUDA event, staged buffer) until the copy is done
        self._lock = threading.Lock()
        self._by_request: dict[str, _Incoming] = {}
        self._by_seq: dict[tuple[str, int], _Incoming] = {}
        self._pairs: dict[str, PairChannel] = {}
        self._joined: set[str] = set()  # pair names seen in join records
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True),
                         threading.Thread(target=self._deadline_loop, daemon=True)]
        for t in self._threads:
            t.start()

    # ---- the owner's side ----------------------------------------------------

    def expect(self, request_id: str, block_ids: list[int], num_cached_blocks: int = 0,
               watched: bool = True) -> None:
        """Register reserved blocks for `request_id`; `block_ids` are the blocks still to
        fill (the first `num_cached_blocks` of the request are already held here). One
        transfer fills every KV head, or several fill a part each (the ranks of a
        tensor-parallel sender, each with the heads it holds: kv_transfer/heads.py);
        it has landed once every head did. watched=False: nobody calls landed() or
        wait() for it (a rank other than 0, whose rank 0 learns of the landing through
        the senders): it is forgotten once landed, under no start lease."""
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id} is already expected")
            self._by_request[request_id] = _Incoming(
                request_id, list(block_ids), num_cached_blocks, "begin",
                self._clock() + self.config.begin_lease_s,
                index=torch.tensor(block_ids, dtype=torch.long, device=self.device),
                watched=watched, unclaimed=set(range(self.layout.num_kv_heads)))

    def landed(self, request_id: str) -> Future:
        """Resolves once every layer landed, or with the transfer's typed error (at the
        latest when a lease expires). Either way the request is forgotten."""
        return self._watch(request_id).done

    def wait(self, request_id: str, timeout: float | None = None) -> None:
        """Block until every layer landed; raises the transfer's typed error. Either
        way the request is forgotten afterwards."""
        incoming = self._watch(request_id)
        try:
            error = incoming.done.exception(
                self.config.timeout_s if timeout is None else timeout)
        except FutureTimeout:
            self._fail(incoming, TransferTimeout(request_id, "not complete within the wait"),
                       P.TIMED_OUT)
            error = incoming.done.exception()
        if error is not None:
            # A copy: the error the transfer keeps would gather every waiter's frames
            # (and what they hold, a sender's pair included) for as long as it is kept.
            raise copy.copy(error)

    def abort(self, request_id: str) -> None:
        incoming = self._by_request.get(request_id)
        if incoming is not None:
            self._fail(incoming, TransferAborted(request_id, "aborted by the receiver"),
                       P.ABORTED)
            self._forget(incoming)

    def publish_ranks(self, addresses: list[str]) -> None:
        """Rank 0 of a tensor-parallel worker: where its other ranks receive their KV
        heads (rank 1 first), for senders that pair with it (kv_transfer/heads.py)."""
        self.store.set(P.RANKS_KEY, json.dumps(list(addresses)))

    @property
    def num_pending(self) -> int:
        return len(self._by_request)

    def close(self) -> None:
        self._closed.set()
        for incoming in list(self._by_request.values()):
            self._fail(incoming, TransferAborted(incoming.request_id, "receiver closed"),
                       P.ABORTED)
        for channel in list(self._pairs.values()):
            channel.close()

    # ---- pairs -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        next_join = 1
        while not self._closed.wait(_POLL_S):
            # check() rather than a timed wait(): an idle receiver logs nothing.
            if not self.store.check([P.join_key(next_join)]):
                continue
            raw = self.store.get(P.join_key(next_join))
            next_join += 1
            try:
                record = P.JoinRecord.decode(raw)
            except ValueError as err:
                log.warning("kv rendezvous %s: refused a join: %s", self.address, err)
                continue
            if not self._admits(record):
                log.warning("kv rendezvous %s: refused a join for pair %r (no proof of the "
                            "cluster secret, or replayed)", self.address, record.pair[:64])
                continue
            threading.Thread(target=self._serve_pair, args=(record,), daemon=True).start()

    def _admits(self, record: P.JoinRecord) -> bool:
        """Anyone who reaches the store can list and read its keys and write a join:
        only one proven with the cluster's secret opens a pair, and each pair once (a
        join replayed from the store is refused)."""
        proven = hmac.compare_digest(record.proof,
                                     P.join_proof(self.config.secret, record.pair))
        with self._lock:
            fresh = record.pair not in self._joined
            self._joined.add(record.pair)
        return proven and fresh

    def _serve_pair(self, record: P.JoinRecord) -> None:
        if record.backend not in ("gloo", "nccl") or (
                record.backend == "nccl" and self.device.type != "cuda"):
            log.warning("kv rendezvous %s: refused pair %r: data backend %r on a %s cache",
                        self.address, record.pair[:64], record.backend[:16], self.device.type)
            return  # the sender's rendezvous times out
        try:
            channel = PairChannel(self.store, record.pair, RECEIVER_RANK, self.host,
                                  record.backend, self.device, self.config.connect_timeout_s)
        except Exception:
            return  # the sender gave up before the rendezvous finished
        self._pairs[record.pair] = channel
        window = ReceiveWindow(channel.data, self._staging, self.config.receive_window_bytes)
        steps: collections.deque = collections.deque()  # members of each open step
        threading.Thread(target=self._collect, args=(channel, window),
                         name=f"kv-land-{record.pair[:32]}", daemon=True).start()
        # A ring of posted control receives: announcements never wait on this thread.
        ring = collections.deque()
        try:
            for _ in range(P.CONTROL_RING):
                buffer = torch.empty(P.CONTROL_BYTES, dtype=torch.uint8)
                ring.append((buffer, channel.post_recv(buffer)))

            def next_message() -> bytes:
                buffer, work = ring.popleft()
                work.wait()
                raw = bytes(buffer.numpy())
                ring.append((buffer, channel.post_recv(buffer)))  # free again: re-post
                return raw

            while not self._closed.is_set():
                kind, seq, a, b, body = P.parse_control(next_message())
                if kind in (P.BEGIN, P.STEP):
                    for _ in range(P.extension_messages(b)):  # the body's tail
                        body += next_message()
                    body = body[:a + b]
                if kind == P.BEGIN:
                    self._begin(channel, seq, P.Handshake.decode(body))
                elif kind == P.STEP:
                    steps.append(self._stepped(channel, window, P.step_members(seq, body)))
                elif kind == P.STEP_SENT:
                    members = steps.popleft() if steps else None
                    if members is None or len(members) != seq:
                        raise RuntimeError(f"STEP_SENT of {seq} transfers does not match "
                                           "the oldest open step")
                    for incoming in members:
                        if incoming is not None:
                            self._made_whole(incoming)
                elif kind == P.ABORT:
                    incoming = self._by_seq.get((record.pair, seq))
                    if incoming is not None:
                        self._fail(incoming, TransferAborted(incoming.request_id,
                                                             "aborted by the sender"), P.ABORTED)
                else:
                    raise RuntimeError(f"unknown control message {kind}")
        except Exception as exc:  # the sender died or closed the pair, or broke protocol
            self._pair_lost(record.pair, exc)
        finally:
            self._pairs.pop(record.pair, None)
            window.close()
            channel.close()

    def _stepped(self, channel: PairChannel, window: ReceiveWindow,
                 members: list[tuple[int, int]]) -> list:
        """A STEP message: plan its payloads, layer-major, and post their receives;
        returns the step's transfers (None where its payloads are dropped).
        A payload nobody wants (refused, ended, out of step) is still received, and
        dropped, so the stream stays in step; one announcing more than a whole cache
        layer breaks the protocol and ends the pair."""
        if len(members) > P.MAX_STEP:
            raise RuntimeError(f"a STEP announced {len(members)} transfers (at most "
                               f"{P.MAX_STEP})")
        owners = []
        for seq, nbytes in members:
            if not 0 <= nbytes <= self._max_payload:
                raise RuntimeError(f"a STEP announced {nbytes} bytes per layer (at most "
                                   f"{self._max_payload} fit this cache)")
            incoming = self._by_seq.get((channel.pair, seq))
            if incoming is not None:
                expected = len(incoming.block_ids) * \
                    self._layout_of(incoming.heads).block_bytes_per_layer
                problem = ("its layers were announced already" if incoming.stepped
                           else None if nbytes == expected else
                           f"{nbytes} bytes per layer announced, expected {expected}")
                incoming.stepped = True
                if problem is not None:
                    self._fail(incoming, TransferAborted(incoming.request_id, problem),
                               P.ABORTED)
                    incoming = None
            owners.append((incoming, nbytes))
        window.plan([Slot(incoming, layer, nbytes) for layer in range(self.layout.num_layers)
                     for incoming, nbytes in owners])
        return [incoming for incoming, _ in owners]

    def _collect(self, channel: PairChannel, window: ReceiveWindow) -> None:
        """Lands each payload of the pair's data stream as its receive completes, in
        stream order; one thread per pair. A slot with no owner is drained and dropped."""
        broken = None
        while (item := window.next()) is not None:
            slot, work, buffer = item
            incoming = slot.owner
            if broken is None:
                try:
                    channel.data.wait(work)
                    window.landed(slot)  # posts the next receives
                except Exception as exc:  # the pair is gone: so is every later payload
                    broken = exc
            if broken is not None:
                if incoming is not None:
                    self._fail(incoming, PeerLostError(
                        incoming.request_id, f"sender connection lost: {broken}"), None)
                continue
            with self._lock:  # several pairs' collectors count at once
                self.bytes_received += slot.nbytes
            if incoming is None or incoming.done.done():
                self._staging.put(buffer)
                continue
            self._land(incoming, slot.layer, buffer[:slot.nbytes])
            self._release_staged(buffer)

    def _release_staged(self, buffer: torch.Tensor) -> None:
        """Back to the pool once the scatter read it: at once on CPU; on CUDA once the
        side stream's copy out of it completed."""
        if self._stream is None:
            self._staging.put(buffer)
            return
        copied = torch.cuda.Event()
        copied.record(self._stream)
        with self._lock:
            self._copies.append((copied, buffer))
            still = []
            for event, held in self._copies:
                if event.query():
                    self._staging.put(held)
                else:
                    still.append((event, held))
            self._copies = still

    def _land(self, incoming: _Incoming, layer: int, payload: torch.Tensor) -> None:
        with incoming.lock:
            if incoming.settled:
                return
            self._scatter(incoming, layer, payload)
            incoming.layers_landed += 1
            complete = self._complete_locked(incoming)
        if complete:
            self._complete(incoming)

    def _made_whole(self, incoming: _Incoming) -> None:
        """Its step's STEP_SENT arrived before any ABORT of it: what lands is its KV."""
        with incoming.lock:
            if incoming.settled:
                return
            incoming.whole = True
            complete = self._complete_locked(incoming)
        if complete:
            self._complete(incoming)

    def _complete_locked(self, incoming: _Incoming) -> bool:
        """Under its lock: every layer landed and none of them can be padding."""
        complete = incoming.whole and incoming.layers_landed == self.layout.num_layers
        incoming.settled = incoming.landed = complete
        if complete and incoming.lease is not None:
            incoming.lease, incoming.expires = "start", self._clock() + self.config.start_lease_s
            if not incoming.watched:
                incoming.lease = None
        return complete

    def _complete(self, incoming: _Incoming) -> None:
        if self._stream is not None:  # a collector or pair thread, never the engine's
            self._stream.synchronize()
        if incoming.parent is not None:  # its request first: once the sender hears OK,
            self._part_landed(incoming.parent)  # a request whole is visible here
        self._finish(incoming, None, P.OK)

    def _part_landed(self, request: _Incoming) -> None:
        with request.lock:
            if request.settled or request.unclaimed or not all(p.landed for p in request.parts):
                return
            request.settled = request.landed = True
            if request.lease is not None:
                request.lease = "start" if request.watched else None
                request.expires = self._clock() + self.config.start_lease_s
        self._finish(request, None, None)

    def _begin(self, channel: PairChannel, seq: int, hs: P.Handshake) -> None:
        pair = channel.pair
        incoming = self._by_request.get(hs.request_id)
        problem = self._check(hs, incoming)
        if problem is None and hs.heads is not None \
                and tuple(hs.heads) != (0, self.layout.num_kv_heads):
            problem = self._claim_part(pair, seq, hs, incoming)
            if problem is None:
                return
            self._send_status(pair, seq, P.REFUSED, problem)
            self._fail(incoming, TransferRefused(hs.request_id, problem), None)
            return
        if problem is None:
            with incoming.lock:  # the claim, atomic with abort and lease expiry
                if incoming.settled:
                    problem = f"request {hs.request_id} was released before its KV arrived"
                elif incoming.parts:  # a part claimed since the check
                    problem = f"request {hs.request_id} is already being received"
                else:
                    incoming.pair, incoming.seq = pair, seq
                    incoming.unclaimed = set()
                    incoming.lease = "transfer" if incoming.lease else None
                    incoming.expires = self._clock() + self.config.timeout_s
        if problem is not None:
            self._send_status(pair, seq, P.REFUSED, problem)
            if incoming is not None and incoming.pair is None:
                self._fail(incoming, TransferRefused(hs.request_id, problem), None)
        else:
            with self._lock:
                self._by_seq[(pair, seq)] = incoming

    def _claim_part(self, pair: str, seq: int, hs: P.Handshake,
                    incoming: _Incoming) -> str | None:
        """A BEGIN of some of the request's KV heads: claimed as a part, or the problem."""
        heads = tuple(hs.heads)
        wanted = set(range(*heads))
        with incoming.lock:
            if incoming.settled:
                return f"request {hs.request_id} was released before its KV arrived"
            if incoming.pair is not None or not wanted <= incoming.unclaimed:
                return (f"request {hs.request_id}: KV heads {list(heads)} are being "
                        "received already")
            part = _Incoming(hs.request_id, incoming.block_ids, incoming.num_cached_blocks,
                             None, 0.0, pair=pair, seq=seq, index=incoming.index,
                             watched=False, heads=heads, parent=incoming)
            incoming.unclaimed -= wanted
            incoming.parts.append(part)
            if incoming.lease == "begin":  # the first part begins the transfer's lease
                incoming.lease = "transfer"
                incoming.expires = self._clock() + self.config.timeout_s
            with self._lock:  # before any ending can forget its request
                self._by_seq[(pair, seq)] = part
        return None

    def _check(self, hs: P.Handshake, incoming: _Incoming | None) -> str | None:
        heads = tuple(hs.heads) if hs.heads is not None else None
        if heads is not None and not 0 <= heads[0] < heads[1] <= self.layout.num_kv_heads:
            return (f"request {hs.request_id}: KV heads {list(heads)} are not among the "
                    f"{self.layout.num_kv_heads} here")
        diffs = self._layout_of(heads).differences(hs.kv_layout)
        if diffs:
            return "KV layout mismatch: " + "; ".join(diffs)
        if incoming is None or incoming.done.done():
            return f"request {hs.request_id} is not expected here (no reserved blocks)"
        if incoming.pair is not None or (incoming.parts and (
                heads is None or heads == (0, self.layout.num_kv_heads))):
            return f"request {hs.request_id} is already being received"
        if (hs.block_ids, hs.num_cached_blocks) != (incoming.block_ids, incoming.num_cached_blocks):
            return (f"block ids differ from the reservation: sender has "
                    f"{len(hs.block_ids)} blocks after {hs.num_cached_blocks} cached, "
                    f"receiver reserved {len(incoming.block_ids)} after "
                    f"{incoming.num_cached_blocks}")
        return None

    def _layout_of(self, heads: tuple[int, int] | None) -> KVLayout:
        """What a transfer filling these KV heads carries."""
        if heads is None:
            return self.layout
        return dataclasses.replace(self.layout, num_kv_heads=heads[1] - heads[0])

    def _scatter(self, incoming: _Incoming, layer: int, payload: torch.Tensor) -> None:
        cache = self.kv_caches[layer]  # [2, num_blocks, block, Hkv, D]
        if incoming.heads is not None:  # a part
            cache = cache[:, :, :, incoming.heads[0]:incoming.heads[1]]
        n = len(incoming.block_ids)
        data = payload.view(self.layout.torch_dtype).view(2, n, *cache.shape[2:])
        if self._stream is None:
            cache.index_copy_(1, incoming.index, data)
            return
        # On the side stream: a pinned host payload is copied up asynchronously; an
        # NCCL one is on the GPU already, its receive complete.
        with torch.cuda.stream(self._stream):
            cache.index_copy_(1, incoming.index, data.to(cache.device, non_blocking=True))

    def _pair_lost(self, pair: str, exc: Exception) -> None:
        for incoming in [i for (p, _), i in list(self._by_seq.items()) if p == pair]:
            self._fail(incoming, PeerLostError(incoming.request_id,
                                               f"sender connection lost: {exc}"), None)

    def _deadline_loop(self) -> None:
        while not self._closed.wait(_POLL_S):
            now = self._clock()
            for incoming in list(self._by_request.values()):
                if incoming.lease is not None and now > incoming.expires:
                    self._expire(incoming)

    def _expire(self, incoming: _Incoming) -> None:
        lease = incoming.lease
        if lease == "start":  # landed, and nobody came for it
            with self._lock:
                if incoming.lease != "start":
                    return  # the owner took it meanwhile
                incoming.lease = None
                self._by_request.pop(incoming.request_id, None)
            self.lease_expiries[lease] += 1
            self._forget(incoming)
            if self.on_release is not None:
                self.on_release(incoming.request_id)
            return
        if lease == "begin":
            why = f"no transfer began within {self.config.begin_lease_s:g}s"
        elif incoming.parts:
            why = (f"{len(incoming.unclaimed)} KV heads unclaimed, parts not all landed "
                   f"within {self.config.timeout_s:g}s")
        else:
            why = (f"{incoming.layers_landed}/{self.layout.num_layers} layers landed "
                   f"within {self.config.timeout_s:g}s")
        if self._fail(incoming, TransferTimeout(incoming.request_id, why), P.TIMED_OUT,
                      lease=lease):
            self.lease_expiries[lease] += 1

    # ---- endings -------------------------------------------------------------------

    def _fail(self, incoming: _Incoming, error: KVTransferError, status: int | None,
              lease: str | None = None) -> bool:
        """Ends the transfer unless something ended it already (or, for an expiry,
        it moved past that `lease` meanwhile); True if this did."""
        with incoming.lock:
            if incoming.settled or (lease is not None and incoming.lease != lease):
                return False
            incoming.settled = True
            incoming.lease = None
        if incoming.parent is not None:  # a part: its request fails with it, its blocks
            self._fail(incoming.parent, error, None)  # back before its sender hears
            self._finish(incoming, error, status)
            return True
        for part in incoming.parts:  # ended before the blocks go: no late layer lands
            with part.lock:
                if part.settled:
                    continue
                part.settled = True
            self._finish(part, TransferAborted(part.request_id, f"another part of its KV "
                                               f"failed: {error}"), P.ABORTED)
        # The blocks go back to their owner before anyone hears of the failure.
        if self.on_release is not None:
            self.on_release(incoming.request_id)
        self._finish(incoming, error, status)
        return True

    def _finish(self, incoming: _Incoming, error, status: int | None) -> None:
        # The owner first, then the sender: once a sender hears OK, the landing is
        # already visible here.
        if error is None:
            incoming.done.set_result(None)
        else:
            incoming.done.set_exception(error)
        if not incoming.watched:
            self._forget(incoming)
        if status is not None and incoming.pair is not None:
            self._send_status(incoming.pair, incoming.seq, status, str(error) if error else "")

    def _send_status(self, pair: str, seq: int, status: int, message: str) -> None:
        """The one status reply a BEGIN gets; a failure's message goes to the store."""
        channel = self._pairs.get(pair)
        if channel is None:
            return  # the pair is gone: the sender fails on its own
        try:
            if status != P.OK:
                self.store.set(P.reason_key(pair, seq), message)
            work, = channel.send([torch.tensor([status], dtype=torch.int64)], P.ack_tag(seq))
            work.wait(datetime.timedelta(seconds=self.config.connect_timeout_s))
        except Exception:
            pass  # the sender went away; nothing is owed to it any more

    def _watch(self, request_id: str) -> _Incoming:
        with self._lock:  # against the start lease expiring now
            incoming = self._by_request.get(request_id)
            if incoming is None:
                raise KeyError(f"request {request_id} is not expected")
            if incoming.lease == "start":
                incoming.lease = None
        incoming.done.add_done_callback(lambda _: self._forget(incoming))
        return incoming

    def _forget(self, incoming: _Incoming) -> None:
        with self._lock:
            if incoming.parent is None and self._by_request.get(incoming.request_id) is incoming:
                del self._by_request[incoming.request_id]
            for each in [incoming, *incoming.parts]:
                if each.pair is not None:
                    self._by_seq.pop((each.pair, each.seq), None)
