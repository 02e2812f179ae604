"""The prefill role of a worker: runs prompts (batched, chunked, prefix-cached) and
streams each request's KV layer by layer to the decode worker the router chose.

Job lifecycle: prefill() waits for the pair with its decode worker (opened, or
re-opened, on that peer's own thread) -> the prompt is queued (max_tokens=1) -> the
step that computes its last prompt chunk begins the transfer and sends each layer as
the forward pass writes it -> the first token is sampled -> the decode worker
confirms every layer landed -> the PrefillResult resolves. Any transfer error
resolves it with that error. Nothing on the engine thread waits on the network: pair
set-up, confirmations and aborts run on one thread per decode worker, so a dead peer
delays only its own requests.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import RequestFailedError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.parallel.messages import RankExport, StepExport
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kv_transfer import KVSender, PeerLostError, SendHandle, TransferTimeout
from pdserve.prefill_worker.destination import Destination
from pdserve.worker.messages import PrefillJob, PrefillResult


@dataclass
class _Job:
    job: PrefillJob
    future: Future
    queued: bool = False  # in the engine (before: waiting for its pair)
    handles: list[SendHandle] = field(default_factory=list)  # rank 0's routes, begun
    ranks: list[int] = field(default_factory=list)  # the other ranks sending routes
    exported: bool = False  # its last prompt chunk's step began its transfer
    computed_at: float = 0.0  # when the step that sampled its first token ended


@dataclass
class _Copy:
    """A copy of a running request's blocks (live migration), as `send` queued it."""
    transfer_id: str
    src: list[int]
    dst: list[int]
    sent: Future  # the bytes sent, once they landed


class PrefillRole:
    """Hosted by a Worker (worker/worker.py), whose engine loop calls export() before
    every forward pass and on_step() after it.

    Tensor parallel (either worker, or both): each rank sends the KV heads it holds to
    the decode ranks that hold them (prefill_worker/destination.py); rank 0's routes
    go from here, the other ranks' with the step's description (worker/rank_kv.py),
    and the first token is reported once every rank's routes landed."""

    def __init__(self, loop: EngineLoop, sender: KVSender, links: tuple = (),
                 heads: tuple[int, int] = (1, 1)):
        """links: ranks 1.. of this worker (worker/rank_kv.py); heads: the model's
        (attention heads, KV heads)."""
        self.loop = loop
        self.sender = sender
        self.links = links
        self.heads = heads
        self._destinations: dict[str, Destination] = {}  # decode rank 0's address ->
        self._jobs: dict[str, _Job] = {}
        self._lanes: dict[str, _Lane] = {}  # receiver address -> its thread
        self._pairing: dict[str, Future] = {}  # receiver address -> its pair being opened
        self._lanes_lock = threading.Lock()
        self._lane_names = itertools.count()
        self._urgent: dict[str, list[_Copy]] = {}  # receiver address -> last copies queued

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def owns(self, request_id: str) -> bool:
        return request_id in self._jobs

    def prefill(self, job: PrefillJob) -> Future:
        """Resolves to a PrefillResult once the KV landed on the decode worker."""
        entry = self._jobs[job.request_id] = _Job(job, Future())
        params = job.params

        def add(engine: LLMEngine) -> None:
            if self._jobs.get(job.request_id) is not entry:
                return  # aborted while its pair was being opened
            engine.add_request(job.request_id, job.job.prompt_token_ids, params,
                               job.job.arrival_time, output_token_ids=job.job.output_token_ids,
                               ttft_slo_s=job.job.ttft_slo_s, forks_here=False)
            entry.queued = True

        def refused(added: Future) -> None:  # bad input: the engine raised, nothing queued
            if added.exception() is not None:
                self._resolve(job.request_id, error=added.exception())

        def paired(ready: Future) -> None:
            if ready.exception() is not None:
                self._resolve(job.request_id, error=ready.exception())
            else:
                self.loop.call(add).add_done_callback(refused)

        self._pair(job.target.receiver_address).add_done_callback(paired)
        return entry.future

    def connect(self, receiver_addresses: list[str]) -> None:
        """Pair with decode workers now rather than on their first request."""
        for future in [self._pair(address) for address in receiver_addresses]:
            future.result()

    def disconnect(self, receiver_addresses: list[str] | None = None) -> None:
        """Closes the pairs with these decode workers (None: with every one) and ends
        their lanes, once the calls queued on each lane ran: a decode worker that left
        or stopped decoding leaves no connection or thread behind here."""
        with self._lanes_lock:
            if receiver_addresses is None:
                receiver_addresses = [*self.sender.receivers, *self._lanes]
            lanes = []
            for address in dict.fromkeys(receiver_addresses):
                self._pairing.pop(address, None)
                lanes.append((address, self._lanes.pop(address, None)))
        for address, lane in lanes:
            if lane is None:
                self._disconnect(address)
            else:
                lane.submit(self._disconnect, address)
                lane.close(join=True)

    def _connect(self, address: str) -> None:
        """On the lane: the pairs of every rank here with the ranks of the decode
        worker at `address` that it has routes to."""
        self.sender.connect(address, any_heads=bool(self.links))
        destination = Destination.of([address, *self.sender.ranks_of(address)],
                                     *self.heads, 1 + len(self.links))
        for other in destination.addresses_from(0):
            self.sender.connect(other, any_heads=True)
        for rank in destination.senders():
            self.links[rank - 1].connect(destination.addresses_from(rank))
        self._destinations[address] = destination

    def _disconnect(self, address: str) -> None:
        destination = self._destinations.pop(address, None)
        self.sender.disconnect(address)
        if destination is None:
            return
        for other in destination.addresses_from(0):
            self.sender.disconnect(other)
        for rank in destination.senders():
            try:
                self.links[rank - 1].disconnect(destination.addresses_from(rank))
            except Exception:  # a lost rank: its worker is going
                pass

    def send(self, transfer_id: str, address: str, src_blocks: list[int],
             dst_blocks: list[int], urgent: bool = False) -> Future:
        """A transfer of KV already in the cache (a running request moving: live
        migration), on the decode worker's lane, every layer at once: resolves to the
        bytes sent once the receiver confirmed them, or with the transfer's error.
        urgent: before the lane's other calls queued (a paused request's last copy);
        the urgent copies queued for one receiver by the time the lane takes them go
        as one step (the moves off a draining worker pause together: their last copies
        then cost about one transfer, not one each in turn)."""
        copy = _Copy(transfer_id, src_blocks, dst_blocks, Future())

        def paired(ready: Future) -> None:
            if ready.exception() is not None:
                copy.sent.set_exception(ready.exception())
            elif not urgent:
                self._lane(address).submit(self._transfer, address, [copy])
            else:
                with self._lanes_lock:
                    batch = self._urgent.get(address)
                    if batch is None:
                        batch = self._urgent[address] = []
                    batch.append(copy)
                    first = len(batch) == 1
                if first:
                    self._lane(address).submit(self._transfer_urgent, address, urgent=True)

        self._pair(address).add_done_callback(paired)
        return copy.sent

    def _transfer_urgent(self, address: str) -> None:
        with self._lanes_lock:
            copies = self._urgent.pop(address, [])
        self._transfer(address, copies)

    def _transfer(self, address: str, copies: list["_Copy"]) -> None:
        """On the lane: the copies as one announced step from every rank here (each its
        own routes, prefill_worker/destination.py); each resolves on its own, to the
        bytes all ranks sent."""
        destination = self._destinations.get(address)
        if destination is None:
            for copy in copies:
                copy.sent.set_exception(PeerLostError(copy.transfer_id,
                                                      f"no open pair with {address}"))
            return
        handles: dict[str, list[SendHandle]] = {}
        for copy in copies:
            begun = handles[copy.transfer_id] = []
            try:
                for route in destination.routes:
                    if route.src_rank == 0:
                        heads, dst_heads = destination.heads(route)
                        begun.append(self.sender.begin(
                            copy.transfer_id, destination.addresses[route.dst_rank], copy.src,
                            copy.dst, connect=False, heads=heads, dst_heads=dst_heads))
            except Exception as exc:
                for handle in begun:
                    self.sender.abort(handle)
                copy.sent.set_exception(exc)
        copies = [c for c in copies if not c.sent.done()]
        mine = [h for c in copies for h in handles[c.transfer_id]]
        try:
            failures = self.sender.send_whole(mine)
            others = {}  # the other ranks' outcomes, by transfer id
            for rank in destination.senders():
                sent = self.links[rank - 1].send_copies(tuple(
                    _copy_route(copy, destination, route) for copy in copies
                    for route in destination.routes if route.src_rank == rank))
                for transfer_id, outcome in sent.items():
                    others.setdefault(transfer_id, []).append(outcome)
        except BaseException as exc:
            for copy in copies:
                for handle in handles[copy.transfer_id]:
                    self.sender.abort(handle)
                copy.sent.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for copy in copies:
            if copy.transfer_id in failures:
                for handle in handles[copy.transfer_id]:
                    self.sender.abort(handle)
                copy.sent.set_exception(failures[copy.transfer_id])
                continue
            try:
                total = sum(self.sender.finish(h).bytes_sent for h in handles[copy.transfer_id])
                for outcome in others.get(copy.transfer_id, ()):
                    total += outcome.check(copy.transfer_id)
                copy.sent.set_result(total)
            except Exception as exc:
                for handle in handles[copy.transfer_id]:
                    self.sender.abort(handle)
                copy.sent.set_exception(exc)
                if isinstance(exc, (PeerLostError, TransferTimeout)):
                    self._destinations.pop(address, None)  # re-checked before the next

    def abort(self, request_id: str) -> bool:
        """False when no prefill job of that id is here."""
        entry = self._jobs.get(request_id)
        if entry is None:
            return False
        self.loop.engine.abort(request_id)
        if entry.exported:
            self._lane(entry.job.target.receiver_address).submit(self._abort_sends, entry)
        elif not entry.queued:  # still waiting for its pair: it never starts
            self._resolve(request_id, error=RuntimeError(
                f"request {request_id} was aborted before it was queued"))
        return True

    def shutdown(self) -> None:
        for lane in self._lanes.values():
            lane.close()

    def _lane(self, address: str) -> "_Lane":
        """The one thread that talks to this decode worker outside the engine loop."""
        with self._lanes_lock:
            lane = self._lanes.get(address)
            if lane is None:
                lane = self._lanes[address] = _Lane(f"kv-peer-{next(self._lane_names)}")
            return lane

    def _pair(self, address: str) -> Future:
        """Resolves once the pair with `address` is open (at once if it is); requests
        arriving while it opens share the one attempt."""
        with self._lanes_lock:
            pairing = self._pairing.get(address)
            if pairing is not None and not pairing.done():
                return pairing
        if self.sender.is_connected(address) and address in self._destinations:
            ready: Future = Future()
            ready.set_result(None)
            return ready
        pairing = self._lane(address).submit(self._connect, address)
        with self._lanes_lock:
            self._pairing[address] = pairing
        return pairing

    def _abort_sends(self, entry: _Job) -> None:
        """On the lane: every rank's routes of the request end."""
        for handle in entry.handles:
            self.sender.abort(handle)
        for rank in entry.ranks:
            try:
                self.links[rank - 1].abort_send(entry.job.request_id)
            except Exception:  # a lost rank: its worker is going
                pass

    # ---- on the engine thread ---------------------------------------------------

    def export(self, out: SchedulerOutput) -> StepExport | None:
        started, exports = [], []
        for request, n in zip(out.requests, out.num_scheduled):
            entry = self._jobs.get(request.request_id)
            if entry is None or request.num_computed_tokens + n != request.num_tokens:
                continue  # not ours, or not the prompt's last chunk yet
            target = entry.job.target
            destination = self._destinations.get(target.receiver_address)
            try:
                if destination is None:
                    raise PeerLostError(request.request_id,
                                        f"no open pair with {target.receiver_address}")
                queued = len(exports)
                for route in destination.routes:
                    heads, dst_heads = destination.heads(route)
                    address = destination.addresses[route.dst_rank]
                    if route.src_rank:
                        exports.append(RankExport(
                            request_id=request.request_id, src_rank=route.src_rank,
                            receiver_address=address, src_block_ids=list(request.block_ids),
                            dst_block_ids=list(target.block_ids),
                            num_cached_blocks=target.num_cached_blocks, src_heads=heads,
                            dst_heads=dst_heads))
                        continue
                    entry.handles.append(self.sender.begin(
                        request.request_id, address, request.block_ids, target.block_ids,
                        target.num_cached_blocks, connect=False, heads=heads,
                        dst_heads=dst_heads))
            except Exception as exc:
                del exports[queued:]  # the other ranks send none of it
                for handle in entry.handles:
                    self.sender.abort(handle)
                entry.handles.clear()
                self._resolve(request.request_id, error=exc)
                continue
            entry.exported = True
            entry.ranks = destination.senders()
            started.extend(entry.handles)
        if not started:
            return None
        # Announced before the forward pass, so each decode worker posts the step's
        # receives while layer 0 computes.
        self._fail_all(self.sender.announce(started))

        def send(layer: int) -> None:
            self._fail_all(self.sender.send_layers(started, layer))

        return StepExport(send=send, ranks=tuple(exports))

    def _fail_all(self, failures: dict) -> None:
        """A lost peer fails its own requests, never the step."""
        for request_id, error in failures.items():
            self._resolve(request_id, error=error)

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Outputs of this role's requests (the worker routes them here)."""
        for out in outputs:
            entry = self._jobs.get(out.request_id)
            if entry is None or not out.finished:
                continue
            if out.finish_reason == "error":  # its sampling failed; the KV is sent
                self.abort(out.request_id)
                self._resolve(out.request_id, error=RequestFailedError(out.request_id,
                                                                       out.error or ""))
                continue
            if not entry.exported or out.finish_reason == "abort":
                self._resolve(out.request_id, error=RuntimeError(
                    f"request {out.request_id} was aborted before its KV was sent"))
                continue
            entry.computed_at = time.time()
            self._lane(entry.job.target.receiver_address).submit(self._await_receiver,
                                                                 entry, out)

    def _await_receiver(self, entry: _Job, out: RequestOutput) -> None:
        """On the lane: every route of every rank landed, or the request's error."""
        kv_bytes, waiting = 0, list(entry.ranks)
        try:
            for handle in entry.handles:
                kv_bytes += self.sender.finish(handle).bytes_sent
            while waiting:
                rank = waiting.pop(0)
                kv_bytes += self.links[rank - 1].finished(
                    out.request_id, self.sender.config.timeout_s).check(out.request_id)
        except Exception as exc:
            for handle in entry.handles:  # the rest end too: nothing of it stays there
                self.sender.abort(handle)
            for rank in waiting:
                try:
                    self.links[rank - 1].abort_send(out.request_id)
                except Exception:
                    pass
            self._resolve(out.request_id, error=exc)
            return
        now = time.time()
        started = out.metrics.first_scheduled_time or out.metrics.arrival_time
        self._resolve(out.request_id, result=PrefillResult(
            request_id=out.request_id, first_token=out.token_ids[-1],
            first_logprob=out.logprobs[-1] if out.logprobs else None,
            first_top_logprobs=out.top_logprobs[-1] if out.top_logprobs else None,
            kv_bytes_sent=kv_bytes, prefill_seconds=now - started,
            transfer_seconds=now - entry.computed_at, num_cached_tokens=out.num_cached_tokens,
            num_host_cached_tokens=out.num_host_cached_tokens,
            prompt_logprobs=out.prompt_logprobs, choices=out.choices or []))

    def _resolve(self, request_id: str, result=None, error=None) -> None:
        entry = self._jobs.pop(request_id, None)
        if entry is None or entry.future.done():
            return
        if error is not None and entry.exported:
            address = entry.job.target.receiver_address
            if isinstance(error, (PeerLostError, TransferTimeout)):
                # a pair of some rank may be gone: every pair is checked (re-opened
                # where lost) before the next request to that worker
                self._destinations.pop(address, None)
            if entry.ranks or entry.handles:  # every rank's routes of it end
                self._lane(address).submit(self._abort_sends, entry)
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(result)


class _Lane:
    """One daemon thread running calls in order (urgent ones before the others queued):
    a peer that hangs holds up only its own lane, and never the process's exit."""

    def __init__(self, name: str):
        self._calls: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, urgent: bool = False) -> Future:
        future: Future = Future()
        self._calls.put((not urgent, next(self._order), (fn, args, future)))
        return future

    def close(self, join: bool = False) -> None:
        """Its thread ends once the calls queued before this ran (join: wait for it)."""
        self._calls.put((True, next(self._order), None))
        if join and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()[2]) is not None:
            fn, args, future = call
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)
            del call, fn, args, future  # nothing of it outlives the call while idle


def _copy_route(copy: _Copy, destination: Destination, route) -> RankExport:
    """A copy's route from a rank other than 0, as that rank sends it."""
    heads, dst_heads = destination.heads(route)
    return RankExport(request_id=copy.transfer_id, src_rank=route.src_rank,
                      receiver_address=destination.addresses[route.dst_rank],
                      src_block_ids=list(copy.src), dst_block_ids=list(copy.dst),
                      num_cached_blocks=0, src_heads=heads, dst_heads=dst_heads)
