"""A request's flight through its phases (lifecycle.py), every worker call through
the WorkerClient seam and bounded by its timeout:

    Disaggregate(P, D): admit the prompt to P's queue (before any KV is held, so
        nothing admitted outwaits its lease) -> reserve KV on D (D refuses: the
        placer decides again without it) -> prefill on P, which streams the KV into
        the reserved blocks and samples token #1 (sent at once, with its text) ->
        start on D -> D's deltas until it finishes.
    Colocate(W): W (role both) takes the whole request -> W's deltas.

Its `finally` releases the flight once, whatever ended it, aborting the request on
exactly the workers its phase holds."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import AsyncIterator, Callable

from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.errors import InvalidRequestError, RequestFailedError
from pdserve.engine.request import choice_id
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.clock import Clock
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (
    NotMoved,
    OverloadedError,
    WorkerDied,
    WorkerError,
    WorkerStalled,
    short_reason,
)
from pdserve.router.lifecycle import Accepted, Cancelled, Flight, Phase, until
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placer import Placer
from pdserve.router.policy.cluster_models import ClusterModels
from pdserve.router.policy.decision import Colocate
from pdserve.router.pool.pool import Pool
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.request_directory import LocalDirectory, RequestDirectory
from pdserve.router.request_metrics import RequestTracker
from pdserve.worker.messages import (
    PrefillJob,
    PrefillResult,
    Reservation,
    TokenDelta,
)

log = logging.getLogger(__name__)


class RequestRunner:
    def __init__(self, pool: Pool, placer: Placer, models: ClusterModels,
                 metrics: RouterMetrics, config: RouterConfig, tokenizer: Tokenizer | None,
                 clock: Clock, on_measured: Callable[[Flight, float, float | None], None],
                 directory: RequestDirectory = LocalDirectory()):
        """on_measured(flight, ttft, tpot): a finished request's latencies; directory:
        where a request id is claimed across router replicas."""
        self.pool, self.placer, self.models, self.metrics = pool, placer, models, metrics
        self.config, self.tokenizer, self.clock = config, tokenizer, clock
        self.on_measured, self.directory = on_measured, directory
        self.flights: dict[str, Flight] = {}
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self._aborting: set[asyncio.Task] = set()  # abort calls to workers in flight

    async def generate(self, req: Accepted) -> AsyncIterator[TokenDelta]:
        """Streams the request's deltas; the last one has finished=True. A worker that
        fails under it (dies, stalls, loses its KV transfer) does not end it while it
        may move (RoutingSpec.migration_limit): it is placed again, as its prompt plus the
        tokens streamed so far, and its stream goes on from there. n > 1: the deltas
        of its n choices, interleaved (TokenDelta.index), each choice's last finished;
        each choice moves alone."""
        flight = self._claim(req)
        if req.params.n > 1:
            flight.choices = [self._choice(flight, i) for i in range(1, req.params.n)]
        try:
            if not await self.directory.claim(req.request_id, req.owner):
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already in "
                                          "flight on another router")
            streams = [self._fly(flight, self._begin)]
            streams += [self._fly(choice, self._await_fork) for choice in flight.choices]
            stream = streams[0] if len(streams) == 1 else _interleaved(streams)
            try:
                async for delta in stream:
                    yield delta
            finally:  # now, not when the collector finds it: it frees what it holds
                await stream.aclose()
        finally:
            for each in (flight, *flight.choices):
                self._release(each)  # (each stream released its own already)
            self._end(flight)

    async def _fly(self, flight: Flight, begin) -> AsyncIterator[TokenDelta]:
        """One sequence's stream: begin(flight) places it (or, for a choice, waits for
        its leader's first token), then it moves off failed workers while it may."""
        track = RequestTracker(self.metrics, flight, self.clock, self.on_measured)
        try:
            while True:
                try:
                    first, skip_text = await begin(flight)
                    if first is not None:
                        yield track.observe(self._progress(flight, first))
                    async for delta in self._stream(flight, skip_text,
                                                    skip_token=first is not None):
                        yield track.observe(self._progress(flight, delta))
                    break
                except NotMoved:
                    raise
                except WorkerError as failure:
                    if not self._may_move(flight):
                        raise
                    self._move(flight, failure)
                    begin = self._begin
        except Cancelled:
            yield track.observe(TokenDelta(request_id=flight.request_id, token_ids=[],
                                           text="", logprobs=[], finished=True,
                                           finish_reason="abort", index=flight.index))
        except BaseException as exc:
            self._unfork(flight, exc)
            raise
        finally:
            track.close()
            self._release(flight)
            self._unfork(flight, Cancelled())

    def abort(self, request_id: str, owner: str = "") -> bool:
        """Ends an in-flight request of this owner: its workers free it now, its stream
        ends with finish_reason "abort" (every choice's, n > 1). Another caller's
        request is not found."""
        flight = self.flights.get(request_id)
        if flight is None or flight.req.owner != owner:
            return False
        for each in (flight, *flight.choices):
            if not each.released:
                each.cancelled.set()  # ends a wait for a worker's answer
                each.queue.put_nowait(Cancelled())  # ends the wait for its next delta
                self._abort_on_holders(each)
        return True

    async def stop(self) -> None:
        if self._aborting:
            await asyncio.wait(self._aborting, timeout=self.config.control_timeout_s)

    def _progress(self, flight: Flight, delta: TokenDelta) -> TokenDelta:
        if delta.request_id != flight.request_id or delta.index != flight.index:
            # a moved request's (Flight.key); a choice's (n > 1)
            delta = replace(delta, request_id=flight.request_id, index=flight.index)
        if delta.finished and delta.num_cached_tokens < flight.num_cached_tokens:
            # the usage (on the last delta; the first, the router's, has it too)
            # counts its prefill worker's prefix hit
            delta = replace(delta, num_cached_tokens=flight.num_cached_tokens,
                            num_host_cached_tokens=flight.num_host_cached_tokens)
        if delta.token_ids:
            if flight.forks and flight.prefill is None:  # colocated: forked there
                self._fork(flight, [None] * len(flight.choices))
            if flight.first_token_at is None:
                flight.first_token_at = self.clock.time()
            self._dequeue(flight)  # its prompt is computed
            flight.output_token_ids += delta.token_ids
            if flight.decode is not None:
                flight.decode.progressed(flight)
        flight.text_sent += len(delta.text)
        return delta

    # ---- n > 1: the choices of one prefill ---------------------------------------------

    @staticmethod
    def _choice(leader: Flight, index: int) -> Flight:
        """Choice `index` of the leader's request: a flight of its own (its id the
        worker's choice id, its parameters SamplingParams.for_choice(index)), waiting
        for the leader's first token."""
        req = leader.req
        choice = Flight(replace(req, request_id=choice_id(req.request_id, index),
                                params=req.params.for_choice(index)), index=index)
        choice.forked = asyncio.get_running_loop().create_future()
        # (its stream may be gone when its leader ends: the outcome is read here)
        choice.forked.add_done_callback(lambda f: f.cancelled() or f.exception())
        return choice

    def _fork(self, leader: Flight, firsts: list[tuple[TokenDelta, int] | None]) -> None:
        """The leader's first token came: its waiting choices forked from it on its
        worker. Disaggregated, each choice's first delta (the router's, from the
        prefill's draws) and how much of its text the decode worker repeats; colocated
        (None), the worker streams them whole."""
        for choice, first in zip(leader.choices, firsts):
            if choice not in leader.unforked:
                continue
            choice.phase = Phase.STREAMING if first is None else Phase.STARTING
            choice.num_cached_tokens = leader.num_cached_tokens
            choice.num_host_cached_tokens = leader.num_host_cached_tokens
            choice.forked.set_result(first or (None, 0))

    @staticmethod
    def _unfork(leader: Flight, exc: BaseException) -> None:
        """The leader ended before its first token: its choices end as it did (a
        worker's failure the leader could not move off is theirs too: not moved)."""
        if isinstance(exc, WorkerError) and not isinstance(exc, NotMoved):
            exc = NotMoved(str(exc))
        for choice in leader.unforked:
            choice.forked.set_exception(exc if isinstance(exc, Exception) else Cancelled())

    async def _await_fork(self, choice: Flight) -> tuple[TokenDelta | None, int]:
        """A choice's begin: its leader's first token (or the leader's end, or an abort)."""
        cancelled = asyncio.ensure_future(choice.cancelled.wait())
        try:
            await asyncio.wait({choice.forked, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if choice.cancelled.is_set():
            raise Cancelled
        return choice.forked.result()

    # ---- moving off a failed worker ---------------------------------------------------

    def _may_move(self, flight: Flight) -> bool:
        """Not past --migration-limit, its client still there, and tokens left to make."""
        return (flight.migrations < self.config.routing.migration_limit
                and not flight.cancelled.is_set() and not flight.released
                and flight.num_output_tokens < flight.req.params.max_tokens)

    def _move(self, flight: Flight, failure: WorkerError) -> None:
        """Lets go of what the failed phase held (the workers free it, or their leases
        do: a dead one frees nothing), and readies the flight to be placed again off
        the worker that failed it (its own prompt and the tokens streamed so far)."""
        failed = flight.decode if flight.phase in (Phase.STARTING, Phase.STREAMING) \
            or flight.prefill is None else flight.prefill
        phase = "decode" if flight.output_token_ids else "prefill"
        if failed is not None:
            flight.failed_on[failed.worker_id] = failed.generation
        self._let_go(flight)
        flight.key = flight.new_key()
        flight.prefill, flight.phase = None, Phase.ACCEPTED
        flight.flush()  # what the failed worker sent after the failure
        flight.migrations += 1
        flight.failure = str(failure)
        reason = ("worker_died" if isinstance(failure, WorkerDied) else "worker_stalled"
                  if isinstance(failure, WorkerStalled) else "worker_error")
        self.metrics.migrations.labels(self.metrics.model_name, reason, phase).inc()
        log.warning("request %s moves off worker %s (%s, %d tokens streamed): %s",
                    flight.request_id, failed.worker_id if failed else "?", reason,
                    flight.num_output_tokens, failure)

    def _avoid(self, flight: Flight) -> frozenset[str]:
        """The workers that failed this request, while the same process runs them."""
        workers = self.pool.workers
        return frozenset(w for w, generation in flight.failed_on.items()
                         if w in workers and workers[w].generation == generation)

    def _dequeue(self, flight: Flight) -> None:
        if flight.queued_on is not None:
            flight.queued_on.unqueue(flight.queued_tokens, flight)
            flight.queued_on = None

    # ---- the phases -----------------------------------------------------------------

    def _claim(self, req: Accepted) -> Flight:
        if req.request_id in self.flights:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
        if self.config.max_inflight and len(self.flights) >= self.config.max_inflight:
            raise OverloadedError("the router is at max_inflight", self.config.retry_after_s)
        flight = self.flights[req.request_id] = Flight(req)
        self.idle.clear()
        return flight

    async def _begin(self, flight: Flight) -> tuple[TokenDelta | None, int]:
        """Carries out the decision. Colocated: the worker takes the whole request
        (None, 0). Disaggregated: returns token #1 as a delta with its text, and how
        much of that text the decode worker's first delta repeats."""
        moved = flight.migrations > 0
        req, refused = flight.moved if moved else flight.req, frozenset()
        num_tokens = len(req.prompt_token_ids)
        while True:
            if moved:  # its first placement's forecasts stay the ones it is judged by
                try:
                    decision = await self.placer.place_moved(flight, req, refused,
                                                             self._avoid(flight))
                except OverloadedError as exc:
                    raise NotMoved(f"{flight.failure}; no other worker could take it: "
                                   f"{exc}") from None
            else:
                decision = flight.predicted = await self.placer.place(flight, refused)
                flight.placed_at = self.clock.time()
            if isinstance(decision, Colocate):
                worker = self.pool.workers[decision.worker]
                # until its first token here, its prompt is queued there
                flight.queued_on, flight.queued_tokens = worker, num_tokens
                worker.enqueue(num_tokens, flight)
                await self._submit(flight, worker)
                return None, 0
            prefill = self.pool.workers[decision.prefill]
            decode = self.pool.workers[decision.decode]
            prefill.enqueue(num_tokens)
            try:
                reservation = await self._reserve(flight, decode)
                if reservation is not None:
                    result = await self._prefill(flight, prefill, reservation)
            finally:
                prefill.unqueue(num_tokens)
            if reservation is not None:
                break
            refused |= {decode.worker_id}
        if result.transfer_seconds > 0:
            self.models.transferred(prefill.worker_id, decode.worker_id,
                                    result.kv_bytes_sent, result.transfer_seconds,
                                    self.clock.monotonic())
        self.metrics.prompt_tokens.inc(num_tokens)
        cached = min(result.num_cached_tokens, len(flight.req.prompt_token_ids))
        if cached > flight.num_cached_tokens:
            flight.num_cached_tokens = cached
            flight.num_host_cached_tokens = min(result.num_host_cached_tokens, cached)
        if flight.forks and len(result.choices) != len(flight.choices):
            raise WorkerError(f"the prefill of {flight.request_id} drew "
                              f"{len(result.choices) + 1} first tokens, not "
                              f"{len(flight.choices) + 1}")
        self._start(flight, result)
        if flight.forks:
            self._fork(flight, [self._first_delta(choice, *drawn)
                                for choice, drawn in zip(flight.choices, result.choices)])
        return self._first_delta(flight, result.first_token, result.first_logprob,
                                 result.first_top_logprobs, result.prompt_logprobs)

    def _first_delta(self, flight: Flight, token: int, logprob: float | None,
                     tops: dict[int, float] | None,
                     prompt_logprobs=None) -> tuple[TokenDelta, int]:
        # The decode worker detokenizes from the same state: its first delta's text
        # begins with exactly this, which the stream then skips.
        req = flight.req
        text = ""
        if self.tokenizer is not None:
            detokenizer = Detokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop,
                                      req.params.min_tokens)
            if flight.output_token_ids:
                detokenizer.resume(flight.output_token_ids, flight.text_sent)
            text = detokenizer.append([token])[0]
        first = TokenDelta(request_id=req.request_id, token_ids=[token],
                           text=text, logprobs=[logprob] if logprob is not None else [],
                           finished=False, num_prompt_tokens=len(req.prompt_token_ids),
                           num_output_tokens=flight.num_output_tokens + 1,
                           top_logprobs=[tops] if tops else [],
                           num_cached_tokens=flight.num_cached_tokens,
                           num_host_cached_tokens=flight.num_host_cached_tokens,
                           prompt_logprobs=None if flight.output_token_ids else prompt_logprobs,
                           index=flight.index)
        return first, len(text)

    async def _reserve(self, flight: Flight, worker: WorkerHandle) -> Reservation | None:
        """The reservation, or None when the worker has no room (or no answer in time)."""
        self._hold(flight, worker, Phase.RESERVING)
        try:
            reservation = await until(flight, worker.client.reserve(
                flight.job(), self.pool.subscriber), self.config.reserve_timeout_s)
        except Cancelled:
            raise
        except InvalidRequestError:
            raise  # it can never fit: 400, not 429
        except Exception as exc:
            self._failure(worker, exc, "")  # a death is news to supervision
            reservation = None  # no answer in time: the worker may reserve late
            self.abort_on(worker, flight.key)
        if reservation is not None:
            flight.phase = Phase.RESERVED
            return reservation
        self._unhold(flight)
        flight.flush()  # what the worker's pump failed it with while it was held there
        return None

    async def _prefill(self, flight: Flight, worker: WorkerHandle,
                       target: Reservation) -> PrefillResult:
        req = flight.req
        flight.prefill, flight.phase = worker, Phase.PREFILLING
        try:
            result = await until(flight, worker.client.prefill(
                PrefillJob(job=flight.job(), target=target)), self.config.prefill_timeout_s)
        except (Cancelled, asyncio.CancelledError, InvalidRequestError, RequestFailedError):
            raise
        except asyncio.TimeoutError:
            raise WorkerError(f"prefill of {req.request_id} took longer than "
                              f"{self.config.prefill_timeout_s:g}s") from None
        except Exception as exc:
            raise self._failure(worker, exc, f"prefill of {req.request_id} failed") from None
        flight.phase = Phase.STARTING  # the KV landed; the prefill worker holds nothing
        return result

    def _failure(self, worker: WorkerHandle, exc: Exception, what: str) -> WorkerError:
        """A worker call's failure: a dead worker is reported to supervision, and the
        error says whether it died (WorkerDied) or only failed, after `what`."""
        died = isinstance(exc, WorkerDied)
        if died:
            self.pool.supervision.died(worker)
        return (WorkerDied if died else WorkerError)(f"{what}: {short_reason(exc)}")

    def _start(self, flight: Flight, result: PrefillResult) -> None:
        # The call as a task of its own, so one cancelled before it ran is closed too.
        # Its choices (n > 1) fork from it there, on their first tokens drawn with its.
        choices = result.choice_tokens if flight.forks else []
        worker = flight.decode
        flight.starting = task = asyncio.ensure_future(
            worker.client.start(flight.key, result.first_token, choices))
        timer = asyncio.get_running_loop().call_later(self.config.start_timeout_s,
                                                      task.cancel)
        task.add_done_callback(lambda done: (timer.cancel(),
                                             self._started(flight, done, worker)))

    async def _submit(self, flight: Flight, worker: WorkerHandle) -> None:
        """The worker (role both) takes the whole request."""
        req = flight.req
        self._hold(flight, worker, Phase.SUBMITTING)
        try:
            await until(flight, worker.client.submit(flight.job(), self.pool.subscriber),
                        self.config.start_timeout_s)
        except (Cancelled, asyncio.CancelledError, InvalidRequestError):
            raise
        except Exception as exc:
            raise self._failure(worker, exc, f"engine worker {worker.worker_id} could not "
                                f"take {req.request_id}") from None
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        flight.phase = Phase.STREAMING

    async def _stream(self, flight: Flight, skip_text: int,
                      skip_token: bool) -> AsyncIterator[TokenDelta]:
        """The decode worker's deltas. Disaggregated, the first repeats token #1 (sent
        already): its id and its text are dropped."""
        while True:
            item = await self._next_delta(flight)
            if skip_token and item.token_ids:
                item, skip_token = replace(item, token_ids=item.token_ids[1:]), False
            if skip_text:
                cut = min(skip_text, len(item.text))
                item, skip_text = replace(item, text=item.text[cut:]), skip_text - cut
            if item.worker_failed:  # the worker's failure: placed again if it may be
                raise WorkerError(f"{flight.request_id} failed on its worker: {item.error}")
            if item.finished:
                flight.phase = Phase.DONE  # the worker freed it
            if item.finish_reason == "error":
                raise RequestFailedError(flight.request_id, item.error or "")
            yield item
            if item.finished:
                return

    async def _next_delta(self, flight: Flight) -> TokenDelta:
        """The next delta, merged with any queued behind it (the caller fell behind).
        Whatever ends the request early arrives on the same queue: a failed start,
        Router.abort, the decode worker's pump (a dead or stalled worker, within its
        bound)."""
        queue = flight.queue
        item = queue.get_nowait() if not queue.empty() else await queue.get()
        while not isinstance(item, BaseException) and not queue.empty():
            later = queue.get_nowait()
            item = later if isinstance(later, BaseException) else item.merged(later)
        if isinstance(item, BaseException):
            raise item
        return item

    @staticmethod
    def _started(flight: Flight, starting: asyncio.Future, worker: WorkerHandle) -> None:
        """The decode worker's start call ended: the request streams, or (if it is
        still starting there) fails; so do the choices forked with it (n > 1)."""
        for each in (flight, *flight.choices):
            if each.phase is not Phase.STARTING or each.decode is not worker or (
                    each is not flight and each.starting is not None):  # its own start's
                continue
            if starting.cancelled() or starting.exception() is not None:
                reason = "timed out" if starting.cancelled() \
                    else short_reason(starting.exception())
                each.queue.put_nowait(WorkerError(
                    f"the decode worker could not start {each.request_id}: {reason}"))
            else:
                each.phase = Phase.STREAMING

    # ---- holding and releasing ------------------------------------------------------

    def _hold(self, flight: Flight, worker: WorkerHandle, phase: Phase) -> None:
        flight.decode, flight.phase = worker, phase
        worker.hold(flight)
        for choice in flight.unforked:  # they fork there: their deltas come from there
            choice.key = choice_id(flight.key, choice.index)
            choice.decode = worker
            worker.hold(choice)

    def _unhold(self, flight: Flight) -> None:
        worker, flight.decode, flight.phase = flight.decode, None, Phase.ACCEPTED
        worker.unhold(flight)
        for choice in flight.unforked:
            if choice.decode is worker:
                worker.unhold(choice)
                choice.decode = None
                choice.flush()

    def _release(self, flight: Flight) -> None:
        """Once per flight (a request's, or one of its choices'), whatever ended it:
        frees what its phase holds."""
        if flight.released:
            return
        flight.released = True
        self._let_go(flight)
        self.placer.queue.freed()

    def _end(self, flight: Flight) -> None:
        """The request ended, every choice of it released: its id is free again."""
        self.flights.pop(flight.request_id, None)
        self.directory.release(flight.request_id)
        if not self.flights:
            self.idle.set()

    def _let_go(self, flight: Flight) -> None:
        """What its phase holds is freed: queued prompt, workers, a start in flight."""
        self._dequeue(flight)
        self._abort_on_holders(flight)
        if flight.decode is not None:
            self._unhold(flight)
        if flight.starting is not None and not flight.starting.done() and not any(
                c.phase is Phase.STARTING and not c.released and c.starting is None
                for c in flight.choices):  # (its choices start by it: its timer bounds it)
            flight.starting.cancel()
        flight.starting = None

    def _abort_on_holders(self, flight: Flight) -> None:
        for worker in flight.holders():
            self.abort_on(worker, flight.key)
        flight.phase = Phase.DONE

    def abort_on(self, worker: WorkerHandle, request_id: str) -> None:
        """Fire and forget, bounded: a hung worker must not hold a caller's stream."""
        task = asyncio.ensure_future(asyncio.wait_for(
            worker.client.abort(request_id, self.pool.subscriber),
            self.config.control_timeout_s))
        self._aborting.add(task)
        task.add_done_callback(self._forget_abort)

    def _forget_abort(self, task: asyncio.Task) -> None:
        self._aborting.discard(task)
        if not task.cancelled():
            task.exception()  # a failed abort: the worker frees it by its lease


async def _interleaved(streams: list[AsyncIterator[TokenDelta]]) -> AsyncIterator[TokenDelta]:
    """The deltas of several streams as they come (an n > 1 request's choices). One
    that raises ends them all (each stream's own end frees what it holds)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(stream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait(delta)
        except BaseException as exc:
            queue.put_nowait(exc)
            raise
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
