"""The router core, shared by the gRPC and HTTP front ends.

Disaggregated (a prefill pool exists): validate + tokenize -> reserve KV on a decode
worker (in policy
order; none has room -> OverloadedError) -> prefill on a prefill worker, which
streams the KV to the reserved blocks and samples token #1 -> start on the decode
worker -> its step stream feeds this request's queue until it finishes. If the
caller goes away (client disconnect, gRPC cancel) or anything fails, the request is
aborted on both workers so their blocks are freed.
Colocated (no prefill pool): the least-loaded engine worker takes the whole request
(chunked prefill, then decode) and streams it the same way.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import check_length, prompt_token_ids
from pdserve.engine.worker_messages import PrefillJob, PrefillResult, Reservation, TokenDelta
from pdserve.router.config import RouterConfig
from pdserve.router.errors import OverloadedError, WorkerError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import decode_order, prefill_choice
from pdserve.router.workers import DecodeHandle, PrefillHandle


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int


@dataclass(frozen=True)
class Accepted:
    """What the router knows once a request is validated."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class Router:
    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, prefill: list[PrefillHandle],
                 decode: list[DecodeHandle], config: RouterConfig = RouterConfig(),
                 colocated: bool = False):
        self.tokenizer = tokenizer
        self.colocated = colocated  # engine workers only (in `decode`), no prefill pool
        self.model = model
        self.config = config
        self.prefill = {w.worker_id: w for w in prefill}
        self.decode = {w.worker_id: w for w in decode}
        self._inflight: dict[str, DecodeHandle] = {}
        self._prefilling: dict[str, PrefillHandle] = {}
        self._aborted: set[str] = set()
        self.metrics = RouterMetrics(model.name)
        self._ids = itertools.count()
        self._refreshing: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        """Whether every pool the mode needs has a worker."""
        return bool(self.decode) and (self.colocated or bool(self.prefill))

    async def start(self) -> None:
        for worker in self.decode.values():
            worker.start_pump()

    async def stop(self) -> None:
        for worker in self.decode.values():
            if worker.pump is not None:
                worker.pump.cancel()

    def accept(self, prompt, params: SamplingParams, request_id: str = "") -> Accepted:
        """Validation and tokenization; raises InvalidRequestError naming the field."""
        ids = prompt_token_ids(prompt, self.tokenizer, self.model.vocab_size)
        check_length(len(ids), params.max_tokens, self.model.max_model_len)
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if rid in self._inflight:
            raise InvalidRequestError("request_id", f"{rid!r} is already in flight")
        return Accepted(rid, ids, params, time.time())

    async def generate(self, req: Accepted) -> AsyncIterator[TokenDelta]:
        """Streams the request's deltas; the last one has finished=True. Disaggregated,
        token #1 goes out as soon as the prefill worker sampled it (TTFT), while the
        decode worker is being started."""
        if self.config.max_inflight and len(self._inflight) >= self.config.max_inflight:
            raise OverloadedError("the router is at max_inflight", self.config.retry_after_s)
        track = _Tracker(self.metrics, req)
        try:
            if self.prefill:
                decode, reservation = await self._reserve(req)
            else:
                decode = await self._place(req)
        except BaseException:
            track.close()
            raise
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        queue: asyncio.Queue = asyncio.Queue()
        decode.streams[req.request_id] = queue
        starting: asyncio.Future | None = None
        first_token: int | None = None  # sent already; dropped from the decode stream
        finished = False
        try:
            try:
                if self.prefill:
                    result = await self._prefill(req, reservation)
                    first_token = result.first_token
                    starting = asyncio.ensure_future(asyncio.wait_for(
                        decode.actor.start.remote(req.request_id, first_token),
                        self.config.start_timeout_s))
                else:
                    await asyncio.wait_for(decode.actor.submit.remote(
                        req.request_id, req.prompt_token_ids, req.params, req.arrival_time),
                        self.config.start_timeout_s)
            except Exception:
                if req.request_id not in self._aborted:
                    raise
                finished = True  # aborted while prefilling: the abort already freed it
                yield TokenDelta(req.request_id, [], "", [], True, "abort")
                return
            if first_token is not None:
                logprobs = [result.first_logprob] if result.first_logprob is not None else []
                tops = [result.first_top_logprobs] if result.first_top_logprobs else []
                yield track.observe(TokenDelta(req.request_id, [first_token], "", logprobs,
                                               False, None, len(req.prompt_token_ids), 0, 1,
                                               tops))
            while True:
                item = await self._next_delta(queue, starting)
                if first_token is not None and item.token_ids:
                    item = replace(item, token_ids=item.token_ids[1:])
                    first_token = None
                finished = item.finished
                yield track.observe(item)
                if finished:
                    return
        finally:
            track.close()
            if starting is not None and not starting.done():
                starting.cancel()
            decode.streams.pop(req.request_id, None)
            self._inflight.pop(req.request_id, None)
            self._aborted.discard(req.request_id)
            decode.inflight -= 1
            if not finished:  # cancelled or failed: free the blocks on both sides
                await self._abort_on_workers(req.request_id, decode)

    async def _next_delta(self, queue: asyncio.Queue, starting) -> TokenDelta:
        """The next delta, merged with any queued behind it (the caller fell behind);
        a decode worker that failed to start the request raises instead of hanging."""
        if starting is not None and not starting.done():
            getter = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait({getter, starting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            item = getter.result() if getter.done() and not getter.cancelled() else None
        else:
            item = None
        if item is None:
            if starting is not None and starting.done() and starting.exception() is not None:
                raise WorkerError(f"the decode worker could not start: {starting.exception()}")
            item = await queue.get()
        while not isinstance(item, Exception) and not queue.empty():
            later = queue.get_nowait()
            item = later if isinstance(later, Exception) else item.merged(later)
        if isinstance(item, Exception):
            raise item
        return item

    async def abort(self, request_id: str) -> bool:
        decode = self._inflight.get(request_id)
        if decode is None:
            return False
        queue = decode.streams.get(request_id)
        self._aborted.add(request_id)
        await self._abort_on_workers(request_id, decode)
        if queue is not None:
            queue.put_nowait(TokenDelta(request_id, [], "", [], True, "abort"))
        return True

    async def refresh_stats(self) -> None:
        """Worker-side free KV (for the policy) and gauges (KV usage, preemptions) for
        /metrics."""
        workers = list(self.decode.values())
        timeout_s = self.config.control_timeout_s
        results = await asyncio.gather(*[asyncio.wait_for(w.actor.stats.remote(), timeout_s)
                                         for w in workers], return_exceptions=True)
        stats = [r for r in results if isinstance(r, dict)]
        for worker, result in zip(workers, results):
            if isinstance(result, dict):
                worker.free_blocks = result["free_blocks"]
        if stats:
            used = sum(s["num_blocks"] - s["free_blocks"] for s in stats)
            self.metrics.kv_usage.set(used / sum(s["num_blocks"] for s in stats))
            self.metrics.preemptions.set(sum(s["num_preemptions"] for s in stats))

    # ---- steps ------------------------------------------------------------------

    async def _reserve(self, req: Accepted) -> tuple[DecodeHandle, Reservation]:
        needed = -(-(len(req.prompt_token_ids) + 1) // self.model.block_size)
        order = decode_order([w.load() for w in self.decode.values()], needed)
        for worker_id in order:
            worker = self.decode[worker_id]
            worker.inflight += 1
            try:
                reservation = await asyncio.wait_for(worker.actor.reserve.remote(
                    req.request_id, req.prompt_token_ids, req.params, req.arrival_time),
                    self.config.reserve_timeout_s)
            except Exception:
                reservation = None
            if reservation is not None:
                self._inflight[req.request_id] = worker
                return worker, reservation
            worker.inflight -= 1
            self._refresh_soon()  # its free-KV count was stale
        raise OverloadedError("no decode worker has room for this request's KV",
                              self.config.retry_after_s)

    async def _place(self, req: Accepted) -> DecodeHandle:
        """Colocated mode: the least-loaded engine worker takes the whole request."""
        order = decode_order([w.load() for w in self.decode.values()], 0)
        if not order:
            raise OverloadedError("no engine worker", self.config.retry_after_s)
        worker = self.decode[order[0]]
        worker.inflight += 1
        self._inflight[req.request_id] = worker
        return worker

    async def _prefill(self, req: Accepted, target: Reservation) -> PrefillResult:
        worker_id = prefill_choice([w.load() for w in self.prefill.values()])
        if worker_id is None:
            raise OverloadedError("no prefill worker", self.config.retry_after_s)
        worker = self.prefill[worker_id]
        worker.queued += 1
        self._prefilling[req.request_id] = worker
        job = PrefillJob(req.request_id, req.prompt_token_ids, req.params, target,
                         req.arrival_time)
        try:
            result = await asyncio.wait_for(worker.actor.prefill.remote(job),
                                            self.config.prefill_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise WorkerError(f"prefill of {req.request_id} failed: {exc}") from None
        finally:
            worker.queued -= 1
            self._prefilling.pop(req.request_id, None)
        return result

    def _refresh_soon(self) -> None:
        """One stats refresh in the background, however many refusals ask for it."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh_stats())

    async def _abort_on_workers(self, request_id: str, decode: DecodeHandle) -> None:
        calls = [decode.actor.abort.remote(request_id)]
        prefill = self._prefilling.get(request_id)
        if prefill is not None:
            calls.append(prefill.actor.abort.remote(request_id))
        # A hung worker must not hold the caller's stream open.
        await asyncio.gather(*[asyncio.wait_for(c, self.config.control_timeout_s) for c in calls],
                             return_exceptions=True)


class _Tracker:
    """One request's metrics: waiting until its first token, then running."""

    def __init__(self, metrics: RouterMetrics, req: Accepted):
        self.m, self.req = metrics, req
        self.waiting = True
        self.last = req.arrival_time
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
        return delta

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            (self.m.waiting if self.waiting else self.m.running).dec()
