"""A served tensor-parallel worker's KV transfers on its ranks other than 0.

Each rank holds its own KV heads (engine/parallel/sharding.py), so each rank sends
and receives its own (kv_transfer/heads.py): rank r > 0 has a KVSender and a
KVReceiver over its cache shard, here. Rank 0 runs the worker's roles and tells the
other ranks what to do:
    prefill  the step description carries the routes each rank sends (RankExport);
             the rank begins, announces and streams them as its forward pass writes
             each layer, like rank 0; rank 0 then collects each rank's outcome
             (finished) before the request's first token is reported
    decode   rank 0 expects a request on every rank before its reservation is
             returned, and aborts it on every rank before its blocks are freed: no
             late layer lands in blocks handed to another request. The ranks' own
             receptions are unwatched (receiver.expect(watched=False)): rank 0 learns
             that they landed from the senders, whose first token waits for them
Rank 0 reaches a rank through a link with these methods: the RankKV itself (ranks on
threads of one process) or a Ray actor's (worker/ranks.py).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.parallel.messages import RankExport
from pdserve.kv_transfer import KVReceiver, KVSender, SendHandle, TransferConfig
from pdserve.kv_transfer import errors as E

_TOMBSTONES = 4096


@dataclass(frozen=True)
class SentKV:
    """One rank's outcome for one request's KV: the bytes it sent, or its error (a
    KVTransferError's class name and message: errors cross Ray as values)."""
    bytes_sent: int = 0
    error: str = ""
    kind: str = ""

    def check(self, request_id: str) -> int:
        """The bytes sent, or the typed error raised."""
        if self.kind:
            raise getattr(E, self.kind, E.KVTransferError)(request_id, self.error)
        return self.bytes_sent


@dataclass(eq=False)
class _Sends:
    handles: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    sent: threading.Event = field(default_factory=threading.Event)  # its last layer went


class RankKV:
    def __init__(self, worker_id: str, rank: int, transfer: TransferConfig, host: str):
        """host: the address its rendezvous and pairs bind (its node's)."""
        self.worker_id, self.rank, self.transfer, self.host = worker_id, rank, transfer, host
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._attached = threading.Event()
        self._sends: dict[str, _Sends] = {}
        # Requests rank 0 gave up on, lately: a step describing one of them that this
        # rank reaches only after the abort (its own thread lags rank 0's) sends none
        # of it, so nothing of it stays here.
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def attach(self, kv_caches: list[torch.Tensor]) -> None:
        """Once the cache is allocated (the follower's InitKVCache)."""
        self.sender = KVSender(f"{self.worker_id}-tp{self.rank}", kv_caches, self.transfer,
                               self.host)
        self.receiver = KVReceiver(kv_caches, self.transfer, self.host)
        self._attached.set()

    def address(self, timeout_s: float) -> str:
        """Its receiver's rendezvous, once its cache is allocated."""
        if not self._attached.wait(timeout_s):
            raise TimeoutError(f"tensor-parallel rank {self.rank} has no KV cache after "
                               f"{timeout_s:g}s")
        return self.receiver.address

    # ---- prefill: on the rank's own thread, in its step ---------------------------------

    def export(self, exports: tuple[RankExport, ...]):
        """The routes this rank sends in this step: begun and announced now; returns
        the per-layer hook that streams them (None when none is this rank's)."""
        with self._lock:
            mine = [e for e in exports if e.src_rank == self.rank
                    and e.request_id not in self._aborted]
        if not mine:
            return None
        handles: list[SendHandle] = []
        touched: dict[str, _Sends] = {}
        with self._lock:
            for e in mine:
                touched[e.request_id] = self._sends.setdefault(e.request_id, _Sends())
        for e in mine:
            sends = touched[e.request_id]
            try:
                handle = self.sender.begin(e.request_id, e.receiver_address, e.src_block_ids,
                                           e.dst_block_ids, e.num_cached_blocks, connect=False,
                                           heads=e.src_heads, dst_heads=e.dst_heads)
            except Exception as exc:
                sends.errors.append(exc)
                continue
            sends.handles.append(handle)
            handles.append(handle)
        self._record(self.sender.announce(handles), touched)
        last = self.sender.layout.num_layers - 1

        def send(layer: int) -> None:
            self._record(self.sender.send_layers(handles, layer), touched)
            if layer == last:
                for sends in touched.values():
                    sends.sent.set()
        if not handles:  # every begin failed: nothing to stream
            for sends in touched.values():
                sends.sent.set()
            return None
        return send

    @staticmethod
    def _record(failures: dict, touched: dict[str, _Sends]) -> None:
        for request_id, error in failures.items():
            touched[request_id].errors.append(error)

    # ---- rank 0's calls -------------------------------------------------------------

    def connect(self, addresses: list[str]) -> None:
        for address in addresses:
            self.sender.connect(address, any_heads=True)

    def disconnect(self, addresses: list[str]) -> None:
        for address in addresses:
            self.sender.disconnect(address)

    def finished(self, request_id: str, timeout_s: float) -> SentKV:
        """Once every route this rank sent for the request was confirmed landed (or
        failed): its outcome. Forgets the request either way."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            sends = self._sends.get(request_id)
        if sends is None:
            return SentKV(error=f"rank {self.rank} sent no KV of it", kind="PeerLostError")
        try:
            if not sends.sent.wait(timeout_s):
                for handle in sends.handles:
                    self.sender.abort(handle)
                return SentKV(error=f"rank {self.rank} did not send its layers within "
                              f"{timeout_s:g}s", kind="TransferTimeout")
            total = 0
            errors = list(sends.errors)
            for handle in sends.handles:
                if errors:  # the request failed: the rest of it ends
                    self.sender.abort(handle)
                    continue
                try:
                    total += self.sender.finish(
                        handle, timeout=max(deadline - handle.started, 0.001)).bytes_sent
                except Exception as exc:  # typed, or not whole (a failed send)
                    self.sender.abort(handle)
                    errors.append(exc)
            if errors:
                return SentKV(bytes_sent=total, error=errors[0].message if isinstance(
                    errors[0], E.KVTransferError) else str(errors[0]),
                    kind=type(errors[0]).__name__)
            return SentKV(bytes_sent=total)
        finally:
            with self._lock:
                self._sends.pop(request_id, None)

    def abort_send(self, request_id: str) -> None:
        with self._lock:
            sends = self._sends.pop(request_id, None)
            self._aborted[request_id] = None
            while len(self._aborted) > _TOMBSTONES:
                self._aborted.popitem(last=False)
        for handle in sends.handles if sends else ():
            self.sender.abort(handle)

    def send_copies(self, copies: tuple[RankExport, ...]) -> dict[str, SentKV]:
        """Live migration: copies of KV already in this rank's cache, announced as one
        step and sent whole (every layer at once); each one's outcome by id."""
        outcomes: dict[str, SentKV] = {}
        handles = []
        for c in copies:
            try:
                handles.append(self.sender.begin(
                    c.request_id, c.receiver_address, c.src_block_ids, c.dst_block_ids,
                    c.num_cached_blocks, connect=False, heads=c.src_heads,
                    dst_heads=c.dst_heads))
            except E.KVTransferError as exc:
                outcomes[c.request_id] = SentKV(error=exc.message, kind=type(exc).__name__)
        failures = self.sender.send_whole(handles)
        for handle in handles:  # a copy's outcome: its routes' bytes, or its first error
            error = failures.get(handle.request_id)
            if error is None and not outcomes.get(handle.request_id, SentKV()).kind:
                try:
                    sent = self.sender.finish(handle).bytes_sent
                    before = outcomes.get(handle.request_id, SentKV())
                    outcomes[handle.request_id] = SentKV(bytes_sent=before.bytes_sent + sent)
                    continue
                except E.KVTransferError as exc:
                    error = exc
            self.sender.abort(handle)
            if error is not None and not outcomes.get(handle.request_id, SentKV()).kind:
                outcomes[handle.request_id] = SentKV(error=error.message,
                                                     kind=type(error).__name__)
        return outcomes

    def expect(self, request_id: str, block_ids: list[int], num_cached_blocks: int,
               watched: bool = False) -> None:
        """watched: rank 0 waits for it (wait_landed), as a live migration's last copy."""
        self.receiver.expect(request_id, block_ids, num_cached_blocks, watched=watched)

    def wait_landed(self, request_id: str, timeout_s: float) -> SentKV:
        """Once a watched reception landed: SentKV() or its error."""
        try:
            self.receiver.wait(request_id, timeout_s)
        except (E.KVTransferError, KeyError) as exc:
            return SentKV(error=str(exc), kind=type(exc).__name__ if isinstance(
                exc, E.KVTransferError) else "TransferAborted")
        return SentKV()

    def abort_expected(self, request_id: str) -> None:
        self.receiver.abort(request_id)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
