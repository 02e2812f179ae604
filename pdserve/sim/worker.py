"""A worker in virtual time, behind the router's WorkerClient seam: the simulator's
workers, and a real implementation of the seam for router tests without Ray.

What decides is production code, imported: the engine's Scheduler and BlockManager
(continuous batching, chunked prefill, prefix caching, preemption) schedule every
step; the worker reports the engine's telemetry (engine/telemetry.py) and runs the
engine's start-up profile before traffic. What is simulated is time: a step lasts
what the profile's StepCost says of its shape (with the profile's noise), a KV
transfer what its TransferCost says of the bytes sent, exposed after the step that
computed the prompt's last chunk. Tokens come from a TokenSource (synthetic, or the
real model's when asked: tokens.py).

A call that changes the batch (submit, start, a prefill job, an abort) takes effect
at the next step boundary, as in the real engine loop; a reservation at once, as the
real one runs beside the forward pass. Deltas go to the request's subscriber (the
router that reserved or submitted it), telemetry to every subscriber. Text is not
detokenized: deltas carry token ids only.

A steady batch (every request decoding, nothing waiting; engine/steady_batch.py's
steps_ahead) is run many steps at a time, up to MAX_STRETCH_S of virtual time: the
same steps, their durations summed, their tokens applied at once to the production
scheduler (steady_batch.advance, tested equal to step-by-step), one delta per
request and one report (a few of its steps, for the latency model) at its end. A
call that changes the batch cuts the stretch after the step in flight, as it would
join the real engine at the next step boundary. Inter-token gaps are counted here,
per step, into the run's ItlHistogram: the deltas of a stretch arrive together."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np

from pdserve.engine import steady_batch
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.host_pool import HostBlockPool
from pdserve.engine.preemption_cost import recompute_seconds
from pdserve.engine.profile import startup_rounds
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.engine.telemetry import IDLE_REPORT_INTERVAL_S, report
from pdserve.engine.validation import check_fits
from pdserve.kv_transfer.config import TransferConfig
from pdserve.router.errors import WorkerDied
from pdserve.sim.itl import ItlHistogram
from pdserve.sim.moves import SimMoves
from pdserve.sim.profile import Profile
from pdserve.sim.tokens import SyntheticTokens, TokenSource
from pdserve.worker.core import WorkerCore, admit_started
from pdserve.worker.messages import (
    BlockCopy,
    IncomingCopy,
    Job,
    Paused,
    PrefillJob,
    PrefillResult,
    Reservation,
    StepBatch,
    TokenDelta,
    WorkerStats,
)
from pdserve.worker.streams import Streams

# The longest a steady batch runs before it reports (the router's view of the worker
# is at most this old; a real worker reports every step).
MAX_STRETCH_S = 1.0
_MIN_SPREAD = 0.5  # a step takes between half and 1.5x its cost, whatever the noise


class TransferFailed(RuntimeError):
    """The KV never landed: the decode side aborted, or is gone."""


@dataclass
class _Stretch:
    """A steady batch's steps run as one: step j ends at ends[j]."""
    seqs: int  # the batch
    context: int  # its KV length at the first step
    durations: np.ndarray  # [steps] seconds
    ends: np.ndarray  # [steps] virtual time
    cut: asyncio.Event
    steps: int = 0  # applied to the scheduler (0: not yet)

    def shape(self, j: int) -> StepShape:
        return StepShape(decode_seqs=self.seqs, decode_context=self.context + j * self.seqs)


@dataclass
class _Prefill:
    """A prefill job here: computing, then its KV in flight to the decode side."""
    job: PrefillJob
    done: asyncio.Future  # its PrefillResult
    started_at: float | None = None  # when first scheduled
    num_cached_tokens: int = 0  # its prompt's prefix-cache hit here
    num_host_cached_tokens: int = 0  # of which, from the host tier


class SimWorker:
    def __init__(self, worker_id: str, role: str, profile: Profile,
                 scheduler: SchedulerConfig = SchedulerConfig(),
                 peers: dict[str, "SimWorker"] | None = None, *, seed: int = 0,
                 tokens: TokenSource | None = None, prefix_caching: bool = True,
                 eos_token_ids: tuple[int, ...] = (), itl: ItlHistogram | None = None,
                 transfer: TransferConfig = TransferConfig(),
                 host_blocks: tuple[int, int] = (0, 0)):
        """peers: address -> worker, shared by a cluster's workers (a transfer lands
        on its target through it); this worker adds itself. seed: its step noise.
        itl: where the gaps between its requests' tokens are counted. transfer: the
        KV transfer's settings (its begin lease bounds what aborts are remembered).
        host_blocks: its host memory's (swap area, prefix tier) blocks: the same
        scheduler swaps and serves host hits, each copy at the profile's
        host_copy_s_per_block (preemption_mode auto prices a swap with it against the
        profile's recompute, as an engine against its own)."""
        self.worker_id, self.profile = worker_id, profile
        # Roles, ownership and aborts as every worker keeps them, in virtual time.
        self.core = WorkerCore(worker_id, role, lambda: asyncio.get_running_loop().time(),
                               transfer.begin_lease_s)
        host = HostBlockPool(*host_blocks) if any(host_blocks) else None
        if host is not None:
            host.load_s_per_block = profile.host_copy_s_per_block
        self.blocks = BlockManager(profile.num_kv_blocks, profile.block_size, prefix_caching,
                                   host=host)
        self.blocks.record_prefix_events = True  # reported in telemetry, as a real worker's
        copy_s = profile.host_copy_s_per_block
        self.scheduler = Scheduler(
            scheduler, self.blocks, swap_is_cheaper=lambda tokens, n: (
                2 * n * copy_s < recompute_seconds(profile.step_cost, tokens)),
            clock=lambda: asyncio.get_running_loop().time())  # the waiting timeout's
        self._copy_debt_s = 0.0  # copies run after a step (stores): paid by the next one
        self.tokens = tokens or SyntheticTokens(profile.vocab_size)
        self.peers = {} if peers is None else peers
        self.peers[worker_id] = self  # its address is its id
        self.paired: set[str] = set()  # the receivers it holds a pair with, as a sender
        self.alive = True
        self._eos = eos_token_ids
        self._noise = np.random.default_rng(seed)
        self._prefills: dict[str, _Prefill] = {}
        self._landing: dict[str, asyncio.Future] = {}  # reserved here, KV on its way
        self._boundary: list[Callable[[], None]] = []  # calls for the next step boundary
        self._wake = asyncio.Event()
        self.streams = Streams(worker_id)  # the subscribers' step streams
        self._steps: list[StepTiming] = []  # since the last report
        self._task: asyncio.Task | None = None
        self._stretch: _Stretch | None = None
        self._itl = itl
        self._last_token_at: dict[str, float] = {}  # when its last token reached the router
        self.moves = SimMoves(self)  # live migration's calls

    @property
    def role(self) -> str:
        return self.core.role

    @property
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---- its life ---------------------------------------------------------------------

    async def boot(self) -> None:
        """Its start-up (the profile's startup_s: process, device, weights), the
        engine's start-up profile in virtual time (its steps seed the router's latency
        model, as a real worker's do), then the engine loop."""
        await asyncio.sleep(self.profile.startup_s)  # virtual time: a load, not a wait
        bm = self.blocks
        for prompts, params in startup_rounds(self.profile.vocab_size, bm.num_blocks,
                                              bm.block_size, self.profile.max_model_len):
            for request_id, ids in prompts.items():
                self.scheduler.add_request(self._request(request_id, ids, params, self._now))
            while self.scheduler.has_unfinished():
                if not await self._step(publish=False):
                    raise RuntimeError(f"{self.worker_id}: the start-up profile cannot run")
        self.scheduler.stats = SchedulerStats()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def kill(self) -> None:
        """Its process dies: every stream ends with an error, every call after raises
        WorkerDied, and what was in flight fails."""
        if not self.alive:
            return
        self.alive = False
        if self._task is not None:
            self._task.cancel()
        self.streams.end(WorkerDied(f"worker {self.worker_id} died"))
        for waiting in [*(p.done for p in self._prefills.values()), *self._landing.values()]:
            if not waiting.done():
                waiting.set_exception(WorkerDied(f"worker {self.worker_id} died"))

    async def _run(self) -> None:
        while True:
            calls, self._boundary = self._boundary, []
            for call in calls:
                call()
            if await self._step():
                continue
            self._wake.clear()
            if self._boundary:
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_REPORT_INTERVAL_S)
            except asyncio.TimeoutError:
                self._publish([])  # idle: telemetry all the same

    async def _step(self, publish: bool = True) -> bool:
        """One engine step, or a steady batch's many; False when there was nothing to
        schedule."""
        if publish and self.tokens.coasts:
            steady = steady_batch.steps_ahead(self.scheduler)
            if steady >= 2:
                await self._coast(steady)
                return True
        self._flush_copies()
        out = self.scheduler.schedule()
        if not out.has_work:
            return False
        copies_s = self._copies_s(out.kv_copies) + self._copy_debt_s
        self._copy_debt_s = 0.0
        if out.is_empty:  # copies alone
            await asyncio.sleep(copies_s)
            self.scheduler.update(out, ModelRunnerOutput())
            return True
        shape, began = StepShape.of(out), self._now
        for request in out.requests:
            job = self._prefills.get(request.request_id)
            if job is not None and job.started_at is None:
                job.started_at = began
        duration = self.profile.step_cost.duration(shape) * self._spread() + copies_s
        await asyncio.sleep(duration)
        result = self.tokens.execute(out)
        end = self._now
        self._send_kv(out, result)  # before update frees the prompts' blocks
        finished = self.scheduler.update(out, result)
        self._flush_copies()
        self._steps.append(StepTiming(shape=shape, duration_s=duration, end_time=end))
        deltas = []
        for request in out.requests:
            rid = request.request_id
            if rid in result.failed or rid in result.sampled_token_ids:
                if rid in self._prefills:
                    self._prefilled(request, end)
                else:
                    tokens = 0 if rid in result.failed else 1
                    deltas.append(_delta(request, tokens))
                    self._token_came(rid, end)
        for request in finished:
            self._done(request.request_id)
        if publish:
            self._publish(deltas)
        return True

    def _copies_s(self, copies) -> float:
        if not copies:
            return 0.0
        return (len(copies.to_host) + len(copies.to_device)) * self.profile.host_copy_s_per_block

    def _flush_copies(self) -> None:
        """Copies named outside a step's schedule (stores of the blocks a step or a
        coast filled, loads of a reservation's host hits) run now, as an engine runs
        them after its step; their time is added to the next step's."""
        if self.blocks.has_copies:
            self._copy_debt_s += self._copies_s(self.blocks.take_copies())
            self.blocks.release_copies()

    async def _coast(self, steps: int) -> None:
        """The steady batch's next `steps` steps (at most MAX_STRETCH_S of them) as
        one, cut short after the step in flight if a call changes the batch."""
        batch, start = list(self.scheduler.running), self._now
        stretch = self._plan(steps, len(batch), sum(r.num_computed_tokens + 1 for r in batch),
                             start)
        self._stretch = stretch
        try:
            await asyncio.wait_for(stretch.cut.wait(), float(stretch.ends[-1]) - start)
        except asyncio.TimeoutError:
            pass
        self._stretch = None
        if not stretch.steps:
            self._apply(stretch, len(stretch.ends))
        n = stretch.steps
        end = float(stretch.ends[n - 1])
        await asyncio.sleep(max(end - self._now, 0.0))
        for j in sorted({0, n // 2, n - 1}):  # enough of its steps for the model's fit
            self._steps.append(StepTiming(shape=stretch.shape(j),
                                          duration_s=float(stretch.durations[j]),
                                          end_time=float(stretch.ends[j])))
        if self._itl is not None:
            self._itl.add(stretch.durations[1:n], weight=stretch.seqs)
        first = float(stretch.ends[0])
        for request in batch:
            self._token_came(request.request_id, first)
            self._last_token_at[request.request_id] = end
        self._publish([_delta(r, n) for r in batch])

    def _plan(self, steps: int, seqs: int, context: int, start: float) -> _Stretch:
        """Up to `steps` steps of a decode batch, each a step of the profile's cost
        (every decode attends one more key each step) times its noise, ending once
        MAX_STRETCH_S has passed."""
        cost = self.profile.step_cost
        first = cost.duration(StepShape(decode_seqs=seqs, decode_context=context))
        steps = min(steps, int(MAX_STRETCH_S / max(first * _MIN_SPREAD, 1e-9)) + 1)
        durations = (first + cost.decode_context_s * seqs * np.arange(steps)) \
            * self._spreads(steps)
        elapsed = np.cumsum(durations)
        n = min(int(np.searchsorted(elapsed, MAX_STRETCH_S)) + 1, steps)
        return _Stretch(seqs, context, durations[:n], start + elapsed[:n], asyncio.Event())

    def _apply(self, stretch: _Stretch, steps: int) -> None:
        steady_batch.advance(self.scheduler, steps, self.tokens.following)
        stretch.steps = steps

    def _cut(self) -> None:
        """A call changes the batch: a stretch in flight ends after its step in flight
        (applied now, so the call sees the blocks its steps took)."""
        stretch = self._stretch
        if stretch is None or stretch.steps:
            return
        ended = int(np.searchsorted(stretch.ends, self._now, side="right"))
        self._apply(stretch, min(ended + 1, len(stretch.ends)))
        stretch.cut.set()

    def _token_came(self, request_id: str, at: float) -> None:
        """A token of the request reached the router at `at`: the gap since its last."""
        last = self._last_token_at.get(request_id)
        if last is not None and self._itl is not None:
            self._itl.add_one(at - last)
        self._last_token_at[request_id] = at

    def _done(self, request_id: str) -> None:
        self.tokens.forget(request_id)
        self._last_token_at.pop(request_id, None)

    def _spread(self) -> float:
        return float(self._spreads(1)[0])

    def _spreads(self, steps: int) -> np.ndarray:
        """Each step's duration over its cost: the profile's noise, bounded."""
        noise = self.profile.step_noise
        if not noise:
            return np.ones(steps)
        return np.clip(self._noise.normal(1.0, noise, steps), _MIN_SPREAD, 2 - _MIN_SPREAD)

    def _publish(self, deltas: list[TokenDelta]) -> None:
        """Each delta to its request's subscriber, the telemetry to all."""
        if not self.streams:
            return  # nobody listens: the steps wait for the first report
        telemetry = report(self.worker_id, self.role, self.scheduler, self._now,
                           tuple(self._steps))
        self._steps = []
        self.streams.publish(self.core.route(deltas), telemetry)

    def _at_boundary(self, call: Callable[[], None]) -> None:
        self._boundary.append(call)
        self._cut()
        self._wake.set()

    def _check(self, call: str) -> None:
        if not self.alive:
            raise WorkerDied(f"worker {self.worker_id} died")
        self.core.require(call)

    def _request(self, request_id: str, prompt: list[int], params: SamplingParams,
                 arrival_time: float, outputs: tuple[int, ...] = (),
                 ttft_slo_s: float | None = None) -> Request:
        """Validated as the engine validates a request, before anything changes.
        outputs: a moved request's tokens so far (Job.output_token_ids); ttft_slo_s:
        its SLO, as the router sends it (the scheduler's waiting timeout)."""
        if request_id in self.scheduler.requests or request_id in self._prefills:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        check_fits(len(prompt), params.max_tokens, len(outputs), self.profile.max_model_len,
                   self.blocks.num_blocks, self.blocks.block_size)
        if params.n > 1:  # its token source draws one sequence per request
            raise InvalidRequestError("n", "the simulator runs one sequence per request")
        return Request(request_id=request_id, prompt_token_ids=list(prompt),
                       sampling_params=params, arrival_time=arrival_time,
                       eos_token_ids=self._eos, max_model_len=self.profile.max_model_len,
                       output_token_ids=list(outputs), ttft_slo_s=ttft_slo_s)

    # ---- WorkerClient -----------------------------------------------------------------

    async def address(self) -> str:
        self._check("address")
        return self.worker_id

    async def connect(self, receiver_addresses: list[str]) -> None:
        self._check("connect")  # a transfer finds its target through `peers`
        self.paired.update(receiver_addresses)

    async def disconnect(self, receiver_addresses: list[str]) -> None:
        self._check("disconnect")
        self.paired.difference_update(receiver_addresses)

    async def reserve(self, job: Job, subscriber: str) -> Reservation | None:
        self._check("reserve")
        return self._reserve(job, subscriber, expect=True)

    def _reserve(self, job: Job, subscriber: str, expect: bool) -> Reservation | None:
        """expect: its KV arrives as one transfer (a prefill's); else in parts (a live
        migration's copies: moves.py)."""
        rid = job.request_id
        if self.core.overtaken(rid):
            return None  # its abort overtook this call
        self.core.check_unclaimed(rid)
        request = self._request(rid, job.prompt_token_ids, job.sampling_params,
                                job.arrival_time, job.output_token_ids, job.ttft_slo_s)
        self._cut()  # the blocks a stretch in flight took are taken
        if not self.scheduler.reserve(request):
            return None
        self.core.claim(rid, subscriber)
        if expect:
            self._landing[rid] = asyncio.get_running_loop().create_future()
        cached = request.num_cached_tokens // self.blocks.block_size
        return Reservation(request_id=rid, receiver_address=self.worker_id,
                           block_ids=list(request.block_ids), num_cached_blocks=cached)

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        self._check("prefill")
        prompt = job.job
        request = self._request(job.request_id, prompt.prompt_token_ids, job.params,
                                prompt.arrival_time, prompt.output_token_ids, prompt.ttft_slo_s)
        self.paired.add(job.target.receiver_address)  # opened on first use, as a real one
        entry = self._prefills[job.request_id] = _Prefill(
            job, asyncio.get_running_loop().create_future())
        self._at_boundary(lambda: self.scheduler.add_request(request)
                          if self._prefills.get(job.request_id) is entry else None)
        return await entry.done

    async def start(self, request_id: str, first_token: int, choices: list[int] = ()) -> None:
        self._check("start")
        landing = self._landing.get(request_id)
        if landing is None:
            raise TransferFailed(f"no KV of {request_id} is expected here")
        await landing
        self._landing.pop(request_id, None)
        self._last_token_at[request_id] = self._now  # the router has token #1
        admitted = asyncio.get_running_loop().create_future()
        self._at_boundary(lambda: self._admit(request_id, first_token, admitted))
        await admitted

    async def submit(self, job: Job, subscriber: str) -> None:
        self._check("submit")
        rid = job.request_id
        self.core.check_unclaimed(rid)
        request = self._request(rid, job.prompt_token_ids, job.sampling_params,
                                job.arrival_time, job.output_token_ids, job.ttft_slo_s)
        self.core.claim(rid, subscriber)
        added = asyncio.get_running_loop().create_future()

        def add() -> None:
            if self.core.overtaken(rid):
                self.core.release(rid)
                added.set_exception(InvalidRequestError("request_id", f"{rid!r} was aborted"))
                return
            self.scheduler.add_request(request)
            added.set_result(None)
        self._at_boundary(add)
        await added

    # Live migration (pdserve/sim/moves.py)

    async def take_over(self, job: Job, subscriber: str) -> Reservation | None:
        self._check("take_over")
        return self._reserve(job, subscriber, expect=False)

    async def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        self._check("expect_copy")
        return self.moves.expect_copy(incoming)

    async def send_blocks(self, copy: BlockCopy) -> int:
        self._check("send_blocks")
        return await self.moves.send_blocks(copy)

    async def pause(self, request_id: str) -> Paused | None:
        self._check("pause")
        return await self.moves.pause(request_id)

    async def abort(self, request_id: str, subscriber: str) -> None:
        """Another subscriber's request of the same id is not this caller's to end."""
        self._check("abort")
        if not self.core.may_abort(request_id, subscriber):
            return
        self.core.aborted(request_id)
        landing = self._landing.pop(request_id, None)
        if landing is not None and not landing.done():
            _fail_quietly(landing, TransferFailed(f"{request_id} was aborted"))
        job = self._prefills.pop(request_id, None)
        if job is not None and not job.done.done():
            _fail_quietly(job.done, TransferFailed(f"{request_id} was aborted"))
        self.moves.forget(request_id)
        self._at_boundary(lambda: self._finish_aborted(request_id))

    async def abort_all(self, subscriber: str) -> int:
        self._check("abort_all")
        self.streams.drop(subscriber)
        orphans = self.core.orphans(subscriber)
        for request_id in orphans:
            await self.abort(request_id, subscriber)
            self.core.release(request_id)
        return len(orphans)

    async def steps(self, stall_timeout_s: float, subscriber: str
                    ) -> AsyncIterator[StepBatch]:
        self._check("steps")
        async with aclosing(self.streams.stream(subscriber, stall_timeout_s)) as batches:
            async for batch in batches:
                yield batch

    async def set_role(self, role: str) -> None:
        self._check("set_role")
        self.core.change_role(role, self.scheduler.num_unfinished or len(self._prefills))
        if role == "decode":  # it sends no KV: its pairs close, as a real worker's do
            self.paired.clear()

    async def stats(self) -> WorkerStats:
        self._check("stats")
        return WorkerStats(num_blocks=self.blocks.num_blocks,
                           free_blocks=self.blocks.num_free_blocks)

    # ---- at step boundaries ------------------------------------------------------------

    def _admit(self, request_id: str, first_token: int, admitted: asyncio.Future) -> None:
        """The KV landed: the request joins the batch after token #1 (published now, so
        it precedes the request's next step)."""
        try:
            request = admit_started(self.scheduler, request_id, first_token)
        except (KeyError, ValueError) as exc:  # aborted meanwhile
            admitted.set_exception(TransferFailed(f"{request_id} cannot start: {exc}"))
            return
        if request.is_finished:
            self._done(request_id)
        self._publish([_delta(request, 1)])
        admitted.set_result(None)

    def _finish_aborted(self, request_id: str) -> None:
        for request in self.scheduler.finish_requests([request_id], FinishReason.ABORT):
            self._done(request_id)
            if self.core.owns(request_id):
                self._publish([_delta(request, 0)])

    # ---- the KV transfer ----------------------------------------------------------------

    def _send_kv(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The prompts computed in full this step: their KV goes to the decode side's
        reserved blocks (the decode side's own prefix hits stay)."""
        for request in out.requests:
            job = self._prefills.get(request.request_id)
            if job is None or request.request_id not in result.sampled_token_ids:
                continue
            target = job.job.target
            peer = self.peers.get(target.receiver_address)
            if peer is not None and peer.alive:
                first, last = target.num_cached_blocks, len(target.block_ids)
                self.tokens.copy_kv(request.block_ids[first:last], peer.tokens,
                                    target.block_ids[first:])

    def transfer_seconds(self, nbytes: int, peer: "SimWorker | None") -> float:
        """A transfer of `nbytes` to `peer` takes what the slower side's profile says
        (workers of different tensor_parallel_size send over different numbers of NICs)."""
        own = self.profile.transfer_cost.seconds(nbytes)
        return own if peer is None else max(own, peer.profile.transfer_cost.seconds(nbytes))

    def _prefilled(self, request: Request, computed_at: float) -> None:
        """The prompt's first token is sampled: what stays exposed of its transfer
        follows, then the decode side confirms."""
        job = self._prefills[request.request_id]
        target = job.job.target
        nbytes = (len(target.block_ids) - target.num_cached_blocks) \
            * self.profile.kv_bytes_per_block
        seconds = self.transfer_seconds(nbytes, self.peers.get(target.receiver_address))
        first_token = request.output_token_ids[-1] if request.output_token_ids else None
        job.num_cached_tokens = request.num_cached_tokens
        job.num_host_cached_tokens = request.num_host_cached_tokens
        asyncio.get_running_loop().call_later(
            seconds, self._transferred, job, first_token, nbytes, seconds)

    def _transferred(self, job: _Prefill, first_token: int | None, nbytes: int,
                     seconds: float) -> None:
        rid = job.job.request_id
        if self._prefills.get(rid) is not job or job.done.done():
            return  # aborted meanwhile
        del self._prefills[rid]
        peer = self.peers.get(job.job.target.receiver_address)
        if first_token is None:
            job.done.set_exception(RuntimeError(f"the prefill of {rid} failed"))
        elif peer is None or not peer.alive or not peer._landed(rid):
            job.done.set_exception(TransferFailed(f"the KV of {rid} did not land: the decode "
                                                  "side gave it up"))
        else:
            started = job.started_at if job.started_at is not None else job.job.job.arrival_time
            job.done.set_result(PrefillResult(
                request_id=rid, first_token=first_token, first_logprob=None,
                first_top_logprobs=None, kv_bytes_sent=nbytes,
                prefill_seconds=self._now - started, transfer_seconds=seconds,
                num_cached_tokens=job.num_cached_tokens,
                num_host_cached_tokens=job.num_host_cached_tokens))

    def _landed(self, request_id: str) -> bool:
        """The decode side: a transfer's KV is in; False if it no longer expects it."""
        landing = self._landing.get(request_id)
        if landing is None or landing.done():
            return False
        landing.set_result(None)  # start() takes it from here
        return True


def _fail_quietly(waiting: asyncio.Future, error: Exception) -> None:
    """Fails a future whose awaiter may be gone (a caller cancelled: the router gave
    the request up), without asyncio logging it as never retrieved."""
    waiting.set_exception(error)
    waiting.exception()  # retrieved: an awaiter still there gets the error all the same


def _delta(request: Request, new_tokens: int) -> TokenDelta:
    """The request's last `new_tokens` tokens as a delta (text is not simulated)."""
    new = request.output_token_ids[-new_tokens:] if new_tokens else []
    return TokenDelta(request_id=request.request_id, token_ids=list(new), text="",
                      logprobs=request.output_logprobs[-new_tokens:] if new else [],
                      finished=request.is_finished,
                      finish_reason=request.finish_reason.value if request.finish_reason
                      else None, num_prompt_tokens=request.num_prompt_tokens,
                      num_cached_tokens=request.num_cached_tokens,
                      num_host_cached_tokens=request.num_host_cached_tokens,
                      num_output_tokens=request.num_output_tokens,
                      top_logprobs=request.output_top_logprobs[-new_tokens:] if new else [],
                      error=request.error)
