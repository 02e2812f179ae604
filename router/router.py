"""The router core, shared by the gRPC and HTTP front ends.

Every request is placed by one pure decision, policy.decide(request, ClusterState),
over a snapshot of the workers (their roles, telemetry, fitted latency models and
the SLO headroom of the requests running on them); the router carries it out.
Disaggregate(P, D): validate + tokenize -> admit to P's bounded prefill queue ->
reserve KV on D (it refuses: decide again without it) -> prefill, which streams the
KV to the reserved blocks and samples token #1 (sent at once, with its text) -> start
on D -> D's step stream feeds this request's queue until it finishes.
Colocate(W): W (role both) takes the whole request.

Membership is live (add_worker, drain_worker, set_worker_role, remove_worker): a
worker joins paired and subscribed, leaves once its requests are done, and one that
died and did not come back in time is evicted and, when the router can spawn
workers, replaced.

A request's state is its Flight (lifecycle.py); `generate` is the happy path and
its `finally` releases the flight once, freeing on the workers exactly what its
phase holds, whatever ended it.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable

import ray

from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.errors import InvalidRequestError, RequestFailedError
from pdserve.engine.latency_calibration import NONE
from pdserve.engine.latency_forecast import decode_step_seconds
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import PromptLimits, check_length, prompt_token_ids
from pdserve.engine.worker_messages import (
    PrefillJob,
    PrefillResult,
    Reservation,
    TokenDelta,
    WorkerTelemetry,
    check_role,
)
from pdserve.router.cluster_models import ClusterModels
from pdserve.router.cluster_state import ClusterState, RequestView, TpotBudget
from pdserve.router.config import RouterConfig
from pdserve.router.decision import (
    Colocate,
    Decision,
    Disaggregate,
    Reject,
    placement_kind,
)
from pdserve.router.errors import (
    OverloadedError,
    WorkerError,
    cause_of,
    is_worker_death,
    short_reason,
)
from pdserve.router.lifecycle import Accepted, Flight, Phase
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import decide
from pdserve.router.prefix_index import block_hashes
from pdserve.router.slo import Slo
from pdserve.router.workers import WorkerHandle

__all__ = ["Accepted", "MembershipError", "ModelInfo", "Router"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_bytes_per_block: int = 0  # one block's KV, all layers (the latency model's transfers)


# Text up to this long is tokenized on the event loop (well under a millisecond);
# longer text in a thread.
_INLINE_TOKENIZE_CHARS = 16384
# A client-chosen request id names the request in logs and aborts: an id, not a payload.
MAX_REQUEST_ID_CHARS = 256


class _Cancelled(Exception):
    """Router.abort asked this request to end."""


class MembershipError(RuntimeError):
    """An admin call that cannot be carried out (unknown worker, no spawner, a worker
    that would not drain in time); `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


# Spawns a fresh worker actor of a role, loaded and ready, not yet paired or
# subscribed (launch.WorkerSpawner).
Spawner = Callable[[str], Awaitable[WorkerHandle]]


class Router:
    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, workers: list[WorkerHandle],
                 config: RouterConfig = RouterConfig(), spawner: Spawner | None = None):
        """workers: paired already (launch pairs them before traffic); `spawner`
        makes add_worker and the replacement of dead workers possible."""
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.spawner = spawner
        self.workers: dict[str, WorkerHandle] = {}
        self.metrics = RouterMetrics(model.name)
        self.models = ClusterModels()
        self._placed = itertools.count()  # requests placed (round robin's sequence)
        for worker in workers:
            self._admit(worker)
        # Names this router to the workers, which stream it its own requests only.
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self._flights: dict[str, Flight] = {}
        self._ids = itertools.count()
        self._refreshing: asyncio.Task | None = None
        self._aborting: set[asyncio.Task] = set()  # abort calls to workers in flight
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        # Set (and replaced) whenever capacity may have freed: a request ended, a
        # worker reported more free KV or a smaller batch. Requests waiting for a
        # placement ask again then.
        self._capacity = asyncio.Event()
        self._reviving: dict[str, asyncio.Task] = {}  # worker id -> its revival
        # Eviction timers of silent workers and fresh workers for evicted ones.
        self._background: set[asyncio.Task] = set()
        self._started = False
        # Called (on the event loop) whenever a worker leaves or rejoins service.
        self.on_change: list = []

    @property
    def prefill(self) -> dict[str, WorkerHandle]:
        """The prefill pool: workers in role prefill."""
        return {k: w for k, w in self.workers.items() if w.role == "prefill"}

    @property
    def decode(self) -> dict[str, WorkerHandle]:
        """Workers that run requests' decode: roles decode and both."""
        return {k: w for k, w in self.workers.items() if w.decodes}

    @property
    def ready(self) -> bool:
        """Whether a request could be placed now: a worker in role both, or a prefill
        and a decode worker, in service."""
        live = [w for w in self.workers.values() if w.alive and not w.draining]
        return any(w.role == "both" for w in live) or (
            any(w.role == "prefill" for w in live) and any(w.decodes for w in live))

    def worker_states(self) -> dict[str, str]:
        """Every worker's id -> "serving", "draining", "stalled" (no step or report
        within the stall bound), "restarting" (its process died and Ray is restarting
        it) or "dead" (given up; evicted soon)."""
        def state(w) -> str:
            if w.worker_id in self._reviving:
                return "restarting"
            if w.alive:
                return "draining" if w.draining else "serving"
            return "stalled" if w.pump is not None and not w.pump.done() else "dead"
        return {w.worker_id: state(w) for w in self.workers.values()}

    def forecast_of(self, request_id: str) -> Decision | None:
        """The decision an in-flight request was placed by, with its forecasts."""
        flight = self._flights.get(request_id)
        return None if flight is None else flight.predicted

    @property
    def num_inflight(self) -> int:
        return len(self._flights)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Returns once no request is in flight (True), or False after timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def start(self) -> None:
        self._started = True
        for worker in self.workers.values():
            self._subscribe(worker)

    async def stop(self) -> None:
        for task in [*self._reviving.values(), *self._background]:
            task.cancel()
        for worker in self.workers.values():
            worker.stop_pump()
        if self._aborting:
            await asyncio.wait(self._aborting, timeout=self.config.control_timeout_s)

    async def accept(self, prompt, params: SamplingParams, request_id: str = "",
                     owner: str = "", slo: Slo = Slo()) -> Accepted:
        """Validation and tokenization; raises InvalidRequestError naming the field.
        Text that cannot fit the context is refused before tokenizing, and long text is
        tokenized off the event loop, which serves every other request meanwhile."""
        if isinstance(prompt, str):
            self.limits.check_chars("prompt", len(prompt))
        elif isinstance(prompt, (list, tuple)):
            self.limits.check_ids("prompt", len(prompt))
        ids = await self._tokenize(len(prompt) if isinstance(prompt, str) else 0,
                                   prompt_token_ids, prompt, self.tokenizer,
                                   self.model.vocab_size)
        return self._accepted(ids, params, request_id, owner, slo)

    async def accept_chat(self, messages: list[dict], params: SamplingParams,
                          request_id: str = "", owner: str = "",
                          slo: Slo = Slo()) -> Accepted:
        """The chat template applied to checked messages, then as accept()."""
        chars = sum(len(m["content"]) for m in messages)
        self.limits.check_chars("messages", chars)
        ids = await self._tokenize(chars, self._chat_token_ids, messages)
        return self._accepted(ids, params, request_id, owner, slo)

    def _chat_token_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.render_chat(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template has them

    @functools.cached_property
    def limits(self) -> PromptLimits:
        return PromptLimits(self.model.max_model_len,
                            self.model.max_model_len * self.tokenizer.max_token_chars)

    async def _tokenize(self, chars: int, fn, *args) -> list[int]:
        if chars <= _INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _accepted(self, ids: list[int], params: SamplingParams, request_id: str,
                  owner: str, slo: Slo) -> Accepted:
        check_length(len(ids), params.max_tokens, self.model.max_model_len)
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} "
                                      "characters")
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        return Accepted(rid, ids, params, time.time(), owner,
                        slo.over(self.config.routing.default_slo))

    async def generate(self, req: Accepted) -> AsyncIterator[TokenDelta]:
        """Streams the request's deltas; the last one has finished=True."""
        flight = self._claim(req)
        track = _Tracker(self.metrics, flight, self._measured)
        try:
            first, skip_text = await self._begin(flight)
            if first is not None:
                yield track.observe(self._progress(flight, first))
            async for delta in self._stream(flight, skip_text, skip_token=first is not None):
                yield track.observe(self._progress(flight, delta))
        except _Cancelled:
            yield track.observe(TokenDelta(req.request_id, [], "", [], True, "abort"))
        finally:
            track.close()
            self._release(flight)

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Ends an in-flight request of this owner: its workers free it now, its stream
        ends with finish_reason "abort". Another caller's request is not found."""
        flight = self._flights.get(request_id)
        if flight is None or flight.req.owner != owner:
            return False
        flight.cancelled.set()
        self._abort_on_holders(flight)
        return True

    async def refresh_stats(self) -> None:
        """What telemetry does not carry, for /metrics: the decode side's KV lease
        expiries. (Load figures arrive with every step: WorkerTelemetry.)"""
        workers = list(self.decode.values())
        timeout_s = self.config.control_timeout_s
        results = await asyncio.gather(*[asyncio.wait_for(w.actor.stats.remote(), timeout_s)
                                         for w in workers], return_exceptions=True)
        stats = [r for r in results if isinstance(r, dict)]
        if stats:
            for lease in stats[0]["lease_expiries"]:  # the receiver's LEASES
                self.metrics.lease_expiries.labels(self.model.name, lease).set(
                    sum(s["lease_expiries"][lease] for s in stats))

    def _progress(self, flight: Flight, delta: TokenDelta) -> TokenDelta:
        if delta.token_ids:
            if flight.first_token_at is None:
                flight.first_token_at = time.time()
                self._dequeue(flight)  # its prompt is computed
            flight.num_output_tokens += len(delta.token_ids)
        return delta

    def _dequeue(self, flight: Flight) -> None:
        if flight.queued_on is not None:
            flight.queued_on.unqueue(len(flight.req.prompt_token_ids))
            flight.queued_on = None

    # ---- the phases -----------------------------------------------------------------

    def _claim(self, req: Accepted) -> Flight:
        if req.request_id in self._flights:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in flight")
        if self.config.max_inflight and len(self._flights) >= self.config.max_inflight:
            raise OverloadedError("the router is at max_inflight", self.config.retry_after_s)
        flight = self._flights[req.request_id] = Flight(req)
        self._idle.clear()
        return flight

    async def _begin(self, flight: Flight) -> tuple[TokenDelta | None, int]:
        """Carries out the decision. Colocated: the worker takes the whole request
        (None, 0). Disaggregated: admits the prompt to the prefill worker's queue
        (before any KV is held, so nothing admitted outwaits its lease), reserves KV on
        the decode worker, prefills and starts; returns token #1 as a delta with its
        text, and how much of that text the decode worker's first delta repeats. A
        decode worker that refuses (no room) is news: the policy decides again
        without it."""
        req, refused = flight.req, frozenset()
        num_tokens = len(req.prompt_token_ids)
        while True:
            decision = flight.predicted = await self._placement(flight, refused)
            flight.placed_at = time.time()
            if isinstance(decision, Colocate):
                worker = self.workers[decision.worker]
                flight.queued_on = worker  # until its first token, its prompt is queued there
                worker.enqueue(num_tokens)
                await self._submit(flight, worker)
                return None, 0
            prefill, decode = self.workers[decision.prefill], self.workers[decision.decode]
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
                                    time.monotonic())
        self.metrics.prompt_tokens.inc(num_tokens)
        self._start(flight, result.first_token)
        # The decode worker detokenizes from the same state: its first delta's text
        # begins with exactly this, which the stream then skips.
        text, _ = Detokenizer(self.tokenizer, req.prompt_token_ids,
                              req.params.stop).append([result.first_token])
        logprobs = [result.first_logprob] if result.first_logprob is not None else []
        tops = [result.first_top_logprobs] if result.first_top_logprobs else []
        first = TokenDelta(req.request_id, [result.first_token], text, logprobs, False, None,
                           num_tokens, 0, 1, tops)
        return first, len(text)

    async def _placement(self, flight: Flight, refused: frozenset[str]) -> Decision:
        """The policy's placement. A refusal for want of capacity (KV, or headroom
        under the TPOT SLOs) waits while the request's TTFT SLO leaves time for a
        placement once capacity frees (and RoutingSpec.max_wait_ms in all), and asks
        again each time some may have; any other refusal, or one with no time to wait,
        raises (429)."""
        waited = False  # in this call (a wait before a decode worker refused was counted)
        while True:
            decision = self._decide(flight.req, refused)
            now = time.monotonic()
            waited_s = 0.0 if flight.waited_since is None else now - flight.waited_since
            if not isinstance(decision, Reject):
                self.metrics.decided(decision)
                if waited:
                    self.metrics.waited_out("placed", waited_s)
                return decision
            wait_s = min(self._may_wait(flight.req, decision),
                         self.config.routing.max_wait_s - waited_s)
            if wait_s <= 0:
                self.metrics.decided(decision)
                if waited:
                    self.metrics.waited_out("refused", waited_s)
                raise OverloadedError(decision.reason, decision.retry_after_s)
            self.metrics.waited.inc()
            waited = True
            if flight.waited_since is None:
                flight.waited_since = now
            await self._capacity_or(flight, wait_s)

    @staticmethod
    def _may_wait(req: Accepted, decision: Reject) -> float:
        """How long the request may wait for capacity and still meet its TTFT SLO (its
        forecast TTFT counts from its arrival, as the SLO does); 0 when it may not, or
        when the policy predicts the capacity frees too late (harm: the requests it
        would push past their SLOs end after that; tpot: its batch shrinks enough after
        that, or is not known to), so the refusal is answered at once rather than at
        its deadline."""
        if decision.kind not in ("kv", "harm", "tpot") or req.slo.ttft_s is None \
                or decision.ttft_s is None:
            return 0.0
        budget = req.slo.ttft_s - decision.ttft_s
        if decision.kind in ("harm", "tpot") and decision.retry_after_s > budget:
            return 0.0
        return budget

    async def _capacity_or(self, flight: Flight, timeout_s: float) -> None:
        """Returns once capacity may have freed, or after timeout_s; Router.abort of
        the request raises _Cancelled."""
        try:
            await self._until(flight, self._capacity.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _measured(self, flight: Flight, ttft_s: float, tpot_s: float | None) -> None:
        """A finished request's latencies: the calibration of the workers whose
        forecasts it was placed by learns how far they were off (the TTFT from its
        placement, as forecast then; the TPOT of its decode worker)."""
        decision = flight.predicted
        if not self.config.routing.calibrate \
                or not isinstance(decision, (Colocate, Disaggregate)) or decision.ttft_s is None:
            return
        waited = flight.placed_at - flight.req.arrival_time
        kind = placement_kind(decision)
        computes, decodes = ((decision.worker, decision.worker) if kind == "colocate"
                             else (decision.prefill, decision.decode))
        # What the model forecast itself: the factors it was scaled by divided out.
        self._calibrate(computes, "ttft", kind, (decision.ttft_s - waited) / decision.ttft_scale,
                        ttft_s - waited)
        if tpot_s is not None and decision.tpot_s:
            self._calibrate(decodes, "tpot", kind, decision.tpot_s / decision.tpot_scale, tpot_s)

    def _calibrate(self, worker_id: str, metric: str, kind: str, forecast_s: float,
                   measured_s: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return  # it left: its calibration went with it
        worker.calibration = self.models.measured(worker_id, metric, kind, forecast_s,
                                                  measured_s, time.monotonic())

    def _capacity_freed(self) -> None:
        self._capacity.set()
        self._capacity = asyncio.Event()

    def _decide(self, req: Accepted, refused: frozenset[str] = frozenset()) -> Decision:
        """The policy's decision on a snapshot of now."""
        ids, bs = req.prompt_token_ids, self.model.block_size
        hits = (self.models.prefixes.hits(block_hashes(ids, bs))
                if self.models.prefixes and self.config.routing.prefix_aware else {})
        cached = {w: n * bs for w, n in hits.items()}
        view = RequestView(num_prompt_tokens=len(ids), blocks_needed=-(-(len(ids) + 1) // bs),
                           refused=refused, slo=req.slo, priority=req.params.priority,
                           max_tokens=req.params.max_tokens, cached_tokens=cached,
                           sequence=next(self._placed),
                           waited_s=max(time.time() - req.arrival_time, 0.0))
        decision = decide(view, self.snapshot(), self.config.routing.routing_policy)
        if cached and not isinstance(decision, Reject):
            computes = decision.worker if isinstance(decision, Colocate) else decision.prefill
            self.metrics.placed_prefix(cached.get(computes, 0), max(cached.values()))
        return decision

    def snapshot(self) -> ClusterState:
        """Every worker's state now, as the policy sees it, with the TPOT headroom of
        this router's requests running on it."""
        base = ClusterState(tuple(w.state() for w in self.workers.values()), time.monotonic(),
                            self.config.telemetry_stale_s,
                            self.config.max_queued_prefill_tokens, self.config.retry_after_s,
                            self.models.transfer_costs, self.model.block_size,
                            self.model.kv_bytes_per_block, self.config.adaptive,
                            self.config.routing.admission)
        timed = [f for f in self._flights.values() if f.req.slo.tpot_s is not None
                 and f.first_token_at is not None and f.phase is Phase.STREAMING]
        if not timed:
            return base
        now, budgets, steps = time.time(), {}, {}
        states = {w.worker_id: w for w in base.workers}
        for flight in timed:
            wid = flight.decode.worker_id
            if wid not in states:
                continue
            if wid not in steps:  # only workers running timed requests
                steps[wid] = decode_step_seconds(base.step_cost(states[wid]),
                                                 base.load(states[wid]))
            budgets.setdefault(wid, []).append(self._budget(flight, now, steps[wid]))
        return replace(base, workers=tuple(
            replace(w, budgets=tuple(budgets[w.worker_id])) if w.worker_id in budgets else w
            for w in base.workers))

    @staticmethod
    def _budget(flight: Flight, now: float, step_s: float) -> TpotBudget:
        """How much longer each of the request's remaining steps may take and still
        meet its TPOT SLO (the mean over its output; it expects max_tokens)."""
        req = flight.req
        total = max(req.params.max_tokens, flight.num_output_tokens + 1)
        remaining = total - flight.num_output_tokens
        deadline = flight.first_token_at + req.slo.tpot_s * (total - 1)
        return TpotBudget(req.params.priority, (deadline - now) / remaining - step_s,
                          remaining)

    async def _reserve(self, flight: Flight, worker: WorkerHandle) -> Reservation | None:
        """The reservation, or None when the worker has no room (or no answer in time)."""
        req = flight.req
        self._hold(flight, worker, Phase.RESERVING)
        try:
            reservation = await self._until(flight, worker.actor.reserve.remote(
                req.request_id, req.prompt_token_ids, req.params, req.arrival_time,
                self.router_id),
                self.config.reserve_timeout_s)
        except _Cancelled:
            raise
        except Exception as exc:
            if isinstance(cause_of(exc), InvalidRequestError):
                raise cause_of(exc) from None  # it can never fit: 400, not 429
            if is_worker_death(exc):
                self._worker_died(worker)
            reservation = None  # no answer in time: the worker may reserve late
            self._abort_on(worker, req.request_id)
        if reservation is not None:
            flight.phase = Phase.RESERVED
            return reservation
        self._unhold(flight)
        return None

    async def _prefill(self, flight: Flight, worker: WorkerHandle,
                       target: Reservation) -> PrefillResult:
        req = flight.req
        flight.prefill, flight.phase = worker, Phase.PREFILLING
        job = PrefillJob(req.request_id, req.prompt_token_ids, req.params, target,
                         req.arrival_time)
        try:
            result = await self._until(flight, worker.actor.prefill.remote(job),
                                       self.config.prefill_timeout_s)
        except (_Cancelled, asyncio.CancelledError):
            raise
        except asyncio.TimeoutError:
            raise WorkerError(f"prefill of {req.request_id} took longer than "
                              f"{self.config.prefill_timeout_s:g}s") from None
        except Exception as exc:
            if isinstance(cause_of(exc), (InvalidRequestError, RequestFailedError)):
                raise cause_of(exc) from None
            if is_worker_death(exc):
                self._worker_died(worker)
            raise WorkerError(f"prefill of {req.request_id} failed: {short_reason(exc)}") \
                from None
        flight.phase = Phase.STARTING  # the KV landed; the prefill worker holds nothing
        return result

    def _start(self, flight: Flight, first_token: int) -> None:
        call = flight.decode.actor.start.remote(flight.request_id, first_token)
        flight.starting = asyncio.ensure_future(
            asyncio.wait_for(call, self.config.start_timeout_s))

    async def _submit(self, flight: Flight, worker: WorkerHandle) -> None:
        """The worker (role both) takes the whole request."""
        req = flight.req
        self._hold(flight, worker, Phase.SUBMITTING)
        try:
            await self._until(flight, worker.actor.submit.remote(
                req.request_id, req.prompt_token_ids, req.params, req.arrival_time,
                self.router_id),
                self.config.start_timeout_s)
        except (_Cancelled, asyncio.CancelledError):
            raise
        except Exception as exc:
            if isinstance(cause_of(exc), InvalidRequestError):
                raise cause_of(exc) from None
            if is_worker_death(exc):
                self._worker_died(worker)
            raise WorkerError(f"engine worker {worker.worker_id} could not take "
                              f"{req.request_id}: {short_reason(exc)}") from None
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
            if item.finished:
                flight.phase = Phase.DONE  # the worker freed it
            if item.finish_reason == "error":
                raise RequestFailedError(flight.request_id, item.error or "")
            yield item
            if item.finished:
                return

    async def _next_delta(self, flight: Flight) -> TokenDelta:
        """The next delta, merged with any queued behind it (the caller fell behind).
        A failed start, Router.abort and the decode worker's pump (which reports a dead
        or stalled worker within its bound) end the wait."""
        queue, first = flight.queue, None
        while first is None and queue.empty():
            getter = asyncio.ensure_future(queue.get())
            cancel = asyncio.ensure_future(flight.cancelled.wait())
            waits = {getter, cancel}
            if flight.starting is not None and not flight.starting.done():
                waits.add(flight.starting)
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                getter.cancel()
                cancel.cancel()
            if flight.cancelled.is_set():
                raise _Cancelled
            self._check_started(flight)
            if getter.done() and not getter.cancelled():
                first = getter.result()
        self._check_started(flight)
        item = first if first is not None else queue.get_nowait()
        while not isinstance(item, Exception) and not queue.empty():
            later = queue.get_nowait()
            item = later if isinstance(later, Exception) else item.merged(later)
        if isinstance(item, Exception):
            raise item
        return item

    def _check_started(self, flight: Flight) -> None:
        starting = flight.starting
        if starting is None or not starting.done() or flight.phase is not Phase.STARTING:
            return
        if starting.cancelled() or starting.exception() is not None:
            reason = "timed out" if starting.cancelled() else short_reason(starting.exception())
            raise WorkerError(f"the decode worker could not start {flight.request_id}: "
                              f"{reason}")
        flight.phase = Phase.STREAMING

    async def _until(self, flight: Flight, call: Awaitable, timeout_s: float):
        """Awaits a worker call, bounded by timeout_s and by Router.abort of the request."""
        task = asyncio.ensure_future(call)
        cancel = asyncio.ensure_future(flight.cancelled.wait())
        try:
            await asyncio.wait({task, cancel}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancel.cancel()
            if not task.done():
                task.cancel()
        if flight.cancelled.is_set():
            raise _Cancelled
        if not task.done() or task.cancelled():
            raise asyncio.TimeoutError
        return task.result()

    # ---- holding and releasing ------------------------------------------------------

    def _hold(self, flight: Flight, worker: WorkerHandle, phase: Phase) -> None:
        flight.decode, flight.phase = worker, phase
        worker.inflight += 1
        worker.streams[flight.request_id] = flight.queue

    def _unhold(self, flight: Flight) -> None:
        worker, flight.decode, flight.phase = flight.decode, None, Phase.ACCEPTED
        worker.inflight -= 1
        worker.streams.pop(flight.request_id, None)

    def _release(self, flight: Flight) -> None:
        """Once per request, whatever ended it: frees what its phase holds."""
        if flight.released:
            return
        flight.released = True
        self._dequeue(flight)
        self._abort_on_holders(flight)
        if flight.decode is not None:
            self._unhold(flight)
        if flight.starting is not None and not flight.starting.done():
            flight.starting.cancel()
        self._flights.pop(flight.request_id, None)
        if not self._flights:
            self._idle.set()
        self._capacity_freed()

    def _abort_on_holders(self, flight: Flight) -> None:
        for worker in flight.holders():
            self._abort_on(worker, flight.request_id)
        flight.phase = Phase.DONE

    def _abort_on(self, worker, request_id: str) -> None:
        """Fire and forget, bounded: a hung worker must not hold a caller's stream."""
        call = worker.actor.abort.remote(request_id, self.router_id)
        task = asyncio.ensure_future(asyncio.wait_for(call, self.config.control_timeout_s))
        self._aborting.add(task)
        task.add_done_callback(_forget_abort(self._aborting))

    # ---- membership -----------------------------------------------------------------

    async def add_worker(self, role: str) -> str:
        """Spawns a worker of `role`, pairs it and subscribes to it, then gives it
        traffic. Returns its id."""
        check_role(role)
        if self.spawner is None:
            raise MembershipError("this router cannot spawn workers", 501)
        worker = await self.spawner(role)
        await self.join(worker)
        return worker.worker_id

    async def join(self, worker: WorkerHandle) -> None:
        """Puts a loaded worker into service: paired with every worker of the other
        side (off the engine threads, before any traffic), subscribed, then chosen."""
        if worker.worker_id in self.workers:
            raise MembershipError(f"worker {worker.worker_id} is already a member")
        worker.draining = True  # no traffic until paired and subscribed
        self._admit(worker)
        await self._pair_with_cluster(worker)
        if self._started:
            self._subscribe(worker)
        worker.draining = False
        log.warning("worker %s (%s) joined", worker.worker_id, worker.role)
        self._changed()

    async def drain_worker(self, worker_id: str, timeout_s: float | None = None) -> None:
        """Stops new work on the worker and waits until this router's requests on it
        are done. It stays a member, draining, until resumed, re-roled or removed.
        Raises MembershipError (504) if they are not done within timeout_s; it stays
        draining then."""
        worker = self._member(worker_id)
        drained = worker.drain()
        self._changed()
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(drained.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise MembershipError(f"worker {worker_id} still holds {worker.inflight + worker.queued} "
                                  f"request(s) after {timeout_s:g}s", 504) from None

    def resume_worker(self, worker_id: str) -> None:
        """A drained (or draining) worker takes new requests again."""
        self._member(worker_id).draining = False
        self._changed()

    async def set_worker_role(self, worker_id: str, role: str) -> None:
        """Drains the worker, changes its role (its weights stay loaded), pairs it for
        the new role and resumes it."""
        check_role(role)
        worker = self._member(worker_id)
        await self.drain_worker(worker_id)
        try:
            await asyncio.wait_for(worker.actor.set_role.remote(role),
                                   self.config.control_timeout_s)
        except Exception as exc:
            raise MembershipError(f"worker {worker_id} could not change role: "
                                  f"{short_reason(exc)}") from None
        worker.role = role
        await self._pair_with_cluster(worker)
        self.resume_worker(worker_id)
        log.warning("worker %s is now in role %s", worker_id, role)

    async def remove_worker(self, worker_id: str, timeout_s: float | None = None,
                            kill: bool = True) -> None:
        """Drains the worker, then it leaves: unsubscribed, forgotten and (kill) its
        actor ended."""
        worker = self._member(worker_id)
        if worker.alive:
            await self.drain_worker(worker_id, timeout_s)
        self._leave(worker, kill)

    def _member(self, worker_id: str) -> WorkerHandle:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise MembershipError(f"no worker {worker_id!r}", 404)
        return worker

    def _admit(self, worker: WorkerHandle) -> None:
        self.workers[worker.worker_id] = worker
        worker.on_report = self._reported

    def _subscribe(self, worker: WorkerHandle) -> None:
        worker.start_pump(self.config.stall_timeout_s, self._worker_died, self.router_id,
                          self._worker_stalled)

    def _leave(self, worker: WorkerHandle, kill: bool) -> None:
        worker.stop_pump()
        revival = self._reviving.pop(worker.worker_id, None)
        if revival is not None:
            revival.cancel()
        self.workers.pop(worker.worker_id, None)
        self.metrics.forget_worker(worker.worker_id)
        self.models.forget(worker.worker_id)
        if kill:
            _kill(worker.actor)
        log.warning("worker %s left", worker.worker_id)
        self._changed()

    def _reported(self, worker: WorkerHandle, telemetry: WorkerTelemetry,
                  previous: WorkerTelemetry | None) -> None:
        self.metrics.observe_worker(telemetry)
        worker.step_cost, worker.prompt_share = self.models.reported(telemetry)
        worker.calibration = self.models.calibration(worker.worker_id, time.monotonic())
        self.models.age_transfers(time.monotonic())
        if previous is None or telemetry.free_blocks > previous.free_blocks \
                or telemetry.running < previous.running:
            self._capacity_freed()  # not on every step: waiting requests would herd

    # ---- workers leaving and rejoining service ---------------------------------------

    def _worker_died(self, worker: WorkerHandle) -> None:
        """Its process died: out of service now, back once Ray has restarted it, or
        evicted (and replaced) if it is not back within revive_timeout_s."""
        if worker.worker_id in self._reviving or worker.worker_id not in self.workers:
            return
        worker.alive = False
        log.error("worker %s died; waiting for its restart", worker.worker_id)
        self._reviving[worker.worker_id] = asyncio.get_running_loop().create_task(
            self._revive(worker))
        self._changed()

    def _worker_stalled(self, worker: WorkerHandle) -> None:
        """Silent past the stall bound (its requests failed already): out of service
        until it reports again (this is called again then); evicted (and replaced) if
        it stays silent for revive_timeout_s more."""
        self._changed()
        if worker.alive:
            return

        async def evict_if_silent() -> None:
            await asyncio.sleep(self.config.revive_timeout_s)  # a bound, not a sync
            if not worker.alive and self.workers.get(worker.worker_id) is worker \
                    and worker.worker_id not in self._reviving:
                log.error("worker %s stayed silent for %gs more; evicting it",
                          worker.worker_id, self.config.revive_timeout_s)
                self._evict(worker)
        task = asyncio.get_running_loop().create_task(evict_if_silent())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _revive(self, worker: WorkerHandle) -> None:
        """Waits for the restarted process to answer (its model loads first), pairs it
        with the live workers of the other side, and puts it back in service. Gives
        up after revive_timeout_s (Ray's max_restarts spent, or it cannot be placed):
        the worker is evicted and, if the router can spawn, replaced by a fresh one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.revive_timeout_s
        backoff = 0.05
        while True:
            try:
                await self._rejoin(worker)
                break
            except asyncio.CancelledError:
                self._reviving.pop(worker.worker_id, None)
                raise
            except Exception as exc:
                if loop.time() + backoff > deadline:
                    log.error("worker %s did not come back within %gs: %s; evicting it",
                              worker.worker_id, self.config.revive_timeout_s,
                              short_reason(exc))
                    self._reviving.pop(worker.worker_id, None)
                    self._evict(worker)
                    return
                await asyncio.sleep(backoff)  # polling Ray, which has no restart event
                backoff = min(2 * backoff, 2.0)
        self._reviving.pop(worker.worker_id, None)
        log.warning("worker %s is back in service", worker.worker_id)
        self._changed()

    def _evict(self, worker: WorkerHandle) -> None:
        self._leave(worker, kill=True)
        if self.spawner is None:
            return
        task = asyncio.get_running_loop().create_task(self._replace(worker.role))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, role: str) -> None:
        try:
            worker_id = await self.add_worker(role)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("no replacement %s worker could be started: %s", role,
                      short_reason(exc))
            return
        log.warning("worker %s replaces an evicted %s worker", worker_id, role)

    async def _rejoin(self, worker: WorkerHandle) -> None:
        timeout_s = self.config.control_timeout_s
        stats = await asyncio.wait_for(worker.actor.stats.remote(), timeout_s)
        worker.num_blocks = stats["num_blocks"]
        worker.address = ""  # a restarted process listens on a new rendezvous
        # A new process, maybe on another node: its prefix cache is empty, and what
        # was measured of the old one (steps, transfers, calibration) is forgotten.
        self.models.forget(worker.worker_id)
        worker.step_cost, worker.prompt_share, worker.calibration = None, 0.0, NONE
        await self._pair_with_cluster(worker)
        self._subscribe(worker)

    async def _pair_with_cluster(self, worker: WorkerHandle) -> None:
        """Pairs the worker, ahead of traffic, with every worker it may send KV to or
        receive KV from: role prefill (and in adaptive mode role both) sends to every
        decode-capable worker. Outside adaptive mode, workers in role both run whole
        requests only and send nothing."""
        timeout_s = self.config.control_timeout_s
        if worker.decodes and not worker.address:
            worker.address = await asyncio.wait_for(worker.actor.address.remote(), timeout_s)
        live = [w for w in self.workers.values() if w.alive and w is not worker]
        pairs = []
        if worker.sends_kv(self.config.adaptive):
            pairs += [(worker, d.address) for d in live if d.decodes and d.address]
        if worker.decodes:
            pairs += [(p, worker.address) for p in live if p.sends_kv(self.config.adaptive)]
        await self._pair(pairs)

    async def _pair(self, pairs: list[tuple[WorkerHandle, str]]) -> None:
        """Pairs prefill workers with decode addresses ahead of traffic, best effort: a
        pair that fails now opens on its first request instead, and a prefill worker
        found dead on the way is taken out of service."""
        timeout_s = self.config.control_timeout_s
        results = await asyncio.gather(*[
            asyncio.wait_for(p.actor.connect.remote([address]), timeout_s)
            for p, address in pairs], return_exceptions=True)
        for (prefill, address), result in zip(pairs, results):
            if isinstance(result, Exception):
                log.warning("pairing %s with %s failed: %s", prefill.worker_id, address,
                            short_reason(result))
                if is_worker_death(result):
                    self._worker_died(prefill)

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()


def _kill(actor) -> None:
    """Ends a worker actor for good (no restart); one already gone is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # a fake at the Ray boundary, or an actor long gone
        log.debug("could not kill a leaving worker: %r", exc)


def _forget_abort(tasks: set):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a failed abort: the worker frees it by its lease
    return done


class _Tracker:
    """One request's metrics: waiting until its first token, then running; at its end
    its SLO attainment and how far its latencies were from the forecast."""

    def __init__(self, metrics: RouterMetrics, flight: Flight,
                 on_measured: Callable[[Flight, float, float | None], None]):
        """on_measured(flight, ttft, tpot) at its end (tpot None: one token)."""
        self.m, self.flight, self.req = metrics, flight, flight.req
        self.on_measured = on_measured
        self.waiting = True
        self.last = flight.req.arrival_time
        self.closed = False
        metrics.waiting.inc()

    def observe(self, delta: TokenDelta) -> TokenDelta:
        now, m = time.time(), self.m
        if delta.token_ids:
            if self.waiting:
                self.waiting = False
                m.waiting.dec()
                m.running.inc()
                m.ttft.observe(now - self.req.arrival_time)
            else:
                m.itl.observe((now - self.last) / len(delta.token_ids))
            self.last = now
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finished:
            m.e2e.observe(now - self.req.arrival_time)
            m.finished(delta.finish_reason or "stop")
            self._judge(now)
        return delta

    def _judge(self, now: float) -> None:
        flight = self.flight
        if flight.first_token_at is None:
            return
        ttft = flight.first_token_at - self.req.arrival_time
        n = flight.num_output_tokens
        tpot = (now - flight.first_token_at) / (n - 1) if n > 1 else None
        self.m.judged(self.req.slo, flight.predicted, ttft, tpot,
                      waited_s=max((flight.placed_at or self.req.arrival_time)
                                   - self.req.arrival_time, 0.0))
        self.on_measured(flight, ttft, tpot)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            (self.m.waiting if self.waiting else self.m.running).dec()
