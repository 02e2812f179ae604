"""The colocated engine loop: add_request / step / abort.

    out = scheduler.schedule()           # pure: who computes how many tokens
    result = runner.execute(out)          # device: forward + sample
    finished = scheduler.update(out, result)

Aborts may arrive from any thread; they are applied at the next step boundary.
"""
from __future__ import annotations

import queue
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_memory import keep_freed_memory
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.host_kv_cache import check_host_memory, host_blocks_for
from pdserve.engine.host_pool import HostBlockPool
from pdserve.engine.kv_cache import bytes_per_block, default_budget_bytes, num_blocks_for_budget
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import Outputs, RequestMetrics, RequestOutput
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.messages import StepExport
from pdserve.engine.preemption_cost import PreemptionCosts
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.spec_decode.proposer import build_proposer
from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.engine.structured_outputs import Grammars
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import check_fits, check_vocab, prompt_token_ids
from pdserve.worker.core import admit_started
from pdserve.worker.messages import Paused

# Prefill role: given a step's schedule, a hook for the forward pass (or None).
KVExport = Callable[[SchedulerOutput], Optional[StepExport]]


@dataclass
class _Tracked:
    request: Request
    detokenizer: Detokenizer
    metrics: RequestMetrics


class LLMEngine:
    def __init__(self, config: EngineConfig, tp_group: TensorParallelGroup | None = None):
        """tp_group: at tensor_parallel_size > 1, the group whose rank 0 this engine is
        (its other ranks serve the steps it broadcasts: engine/parallel/)."""
        if config.tensor_parallel_size != (tp_group.size if tp_group else 1):
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs a group of as "
                "many ranks: start the engine through LLM(...) or a worker, which start them")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()
        config = replace(config, model=str(resolve_model_path(config.model)))
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model)
        self.max_model_len = max_model_len_of(config, self.model_config)
        self.eos_token_ids = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        # Structured outputs: the grammars compiled for this vocabulary, and the
        # requests' matchers (the sampler masks with them).
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                 self.eos_token_ids)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, tp_group,
                                  self.grammars)
        # Speculative decoding's proposer (a draft model loads here, before the KV
        # cache is sized: its weights and its KV per block count against the budget).
        self.proposer = build_proposer(config, self.model_config, self.max_model_len)
        cache = config.cache
        num_blocks = cache.num_kv_blocks or num_blocks_for_budget(
            self.runner.model_config, cache.block_size, self.runner.dtype,  # this rank's
            cache.kv_cache_memory_bytes or default_budget_bytes(config, self.model_config),
            extra_bytes_per_block=self.proposer.bytes_per_block() if self.proposer else 0)
        # Host memory per rank: the swap area and the prefix tier, in this rank's blocks.
        check_host_memory(cache.swap_space, cache.kv_offloading_size,
                          config.tensor_parallel_size)
        per_block = bytes_per_block(self.runner.model_config, cache.block_size, self.runner.dtype)
        host = HostBlockPool(host_blocks_for(cache.swap_space, per_block),
                             host_blocks_for(cache.kv_offloading_size, per_block))
        self.runner.init_kv_cache(num_blocks, host.num_blocks)
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                          host=host if host.num_blocks else None)
        self.block_manager.copies_on_other_ranks = config.tensor_parallel_size > 1
        spec = config.speculative_config
        # The step timings seed the latency model that prices a recompute (auto).
        self.step_timings: deque[StepTiming] = deque(maxlen=256)
        self.num_steps = 0
        self.preemption_costs = None
        if host.num_blocks:
            store_s, load_s = self.runner.host_cache.seconds_per_block(self.runner.kv_caches, 8)
            host.load_s_per_block = load_s
            if host.num_swap_blocks:
                self.preemption_costs = PreemptionCosts(
                    store_s + load_s, lambda: self.step_timings, lambda: self.num_steps)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
            clock=time.time,  # requests' arrival_time is wall time
            swap_is_cheaper=self.preemption_costs.swap_is_cheaper
            if self.preemption_costs else None)
        self._tracked: dict[str, _Tracked] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()

    @classmethod
    def from_kwargs(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, *,
                    output_token_ids: Sequence[int] = (), text_sent: int = 0,
                    ttft_slo_s: float | None = None, forks_here: bool = True) -> Request:
        """output_token_ids, text_sent: a request moved here (Job's fields of the names):
        its prompt and those tokens are computed, and it goes on after them.
        ttft_slo_s: the TTFT it is judged by (the scheduler's waiting timeout).
        forks_here: n > 1, its choices run here (else, a prefill worker's, their first
        tokens are only drawn: RequestOutput.choices)."""
        request = self._new_request(request_id, prompt, params, arrival_time,
                                    output_token_ids)
        request.ttft_slo_s = ttft_slo_s
        request.forks_here = forks_here
        self.scheduler.add_request(request)
        self._track(request, text_sent)
        return request

    def prepare(self, params: SamplingParams) -> None:
        """What a request's parameters need before it enters the engine, done now:
        its structured-output constraint compiled (cached). Thread-safe; a worker calls
        it off the engine's thread and state lock (a new schema takes milliseconds,
        the first one a second), so adding the request then costs a cache lookup.
        Raises InvalidRequestError naming structured_outputs."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def reserve_remote(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None,
                       arrival_time: float | None = None, *,
                       output_token_ids: Sequence[int] = (),
                       text_sent: int = 0) -> Request | None:
        """Decode role: reserve blocks for a request prefilled elsewhere (a moved one's
        outputs so far included). Returns the request (its block_ids; the first
        num_cached_tokens // block_size of them already hold the prompt's prefix
        here), or None when there is no room."""
        request = self._new_request(request_id, prompt, params, arrival_time,
                                    output_token_ids)
        if not self.scheduler.reserve(request):
            return None
        self._track(request, text_sent)
        return request

    def admit_remote(self, request_id: str, first_token: int,
                     choices: Sequence[int] = ()) -> list[RequestOutput]:
        """Decode role: the prompt's KV landed; continue from the prefill's first token
        (choices: n > 1, those of its choices 1 .. n-1, which fork from it here). Each
        choice's output, then its own (a choice's owner is found through it)."""
        request = admit_started(self.scheduler, request_id, first_token, choices)
        tracked = self._tracked[request_id]
        now = tracked.metrics.first_token_time = time.time()
        new_text, stop = tracked.detokenizer.append([first_token])
        if stop is not None and not request.is_finished:
            self.scheduler.finish_requests([request_id], FinishReason.STOP)
        forked = self._forked({request_id: tracked.metrics}, now)
        return [*forked, self._output(tracked, [first_token], new_text, now)]

    def pause(self, request_id: str) -> Paused | None:
        """Live migration, the source: the running request leaves the batch with its KV
        kept; what it produced so far (None: it is not running)."""
        request = self.scheduler.pause(request_id)
        if request is None:
            return None
        return Paused(request_id=request_id,
                      output_token_ids=list(request.output_token_ids),
                      text_sent=self._tracked[request_id].detokenizer.emitted,
                      num_computed_tokens=request.num_computed_tokens)

    def grow(self, request_id: str, token_ids: list[int], text_sent: int) -> bool:
        """Live migration, the target: the tokens the request made on its source since
        its reservation here, and how much of their text its client has (False: no
        room for them)."""
        if not self.scheduler.grow(request_id, token_ids):
            return False
        self._tracked[request_id].detokenizer.resume(token_ids, text_sent)
        return True

    def resume_moved(self, request_id: str) -> None:
        """Live migration, the target: its KV landed; it decodes on from here."""
        self.scheduler.resume_moved(request_id)

    def abort(self, request_ids: str | list[str]) -> None:
        """Thread-safe; blocks are freed at the next step boundary."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._aborts.put(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._aborts.empty()

    def has_work(self) -> bool:
        """Whether step() would do anything now (a reserved request waiting for its
        KV gives it nothing to do)."""
        return self.scheduler.has_schedulable() or not self._aborts.empty()

    @property
    def stats(self):
        return self.scheduler.stats

    def close(self) -> None:
        """Ends the other ranks of a tensor-parallel engine (nothing to end otherwise)."""
        self.runner.close()

    # ---- the loop -------------------------------------------------------------

    def step(self, export: KVExport | None = None,
             state_lock: AbstractContextManager = nullcontext()) -> list[RequestOutput]:
        """One engine step. `export` (prefill role) sees the step's schedule before the
        forward pass and may return a hook called as each layer's KV is written.
        `state_lock` is held while the scheduler and block manager change (schedule,
        update) and released for the forward pass, which reads only the scheduled
        requests: another thread holding it may reserve blocks meanwhile."""
        began = time.perf_counter()
        with state_lock:
            outputs = self._apply_aborts()
            out = self.scheduler.schedule()
            if not out.has_work:
                return outputs
            shape = StepShape.of(out)
            now = time.time()
            for request in out.requests:
                metrics = self._tracked[request.request_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
        exported = export(out) if export is not None and out.requests else None
        result = self.runner.execute(out, exported.send if exported else None,
                                     exported.ranks if exported else ())
        if self.proposer is not None and out.kv_copies and out.kv_copies.within:
            self.proposer.copy_blocks(out.kv_copies.within)  # (its KV of a shared block)
        with state_lock:
            self.scheduler.update(out, result)
            self._store_computed_blocks()
            now = time.time()
            if result.choices:  # a choice's first, its owner found through its parent's
                outputs.extend(self._forked(
                    {rid: self._tracked[rid].metrics for rid in result.choices}, now))
            for rid in result.sampled_token_ids:
                outputs.append(self._emit(self._tracked[rid], now))
            for rid, verified in result.verified.items():
                outputs.append(self._emit(self._tracked[rid], now, len(verified.token_ids)))
            for rid in result.failed:
                outputs.append(self._output(self._tracked[rid], [], "", now))
            if self.proposer is not None:
                ready = self._ready_for_drafts(out)
        if self.proposer is not None:
            # Outside the lock, like the forward pass: a draft model runs here.
            drafts = self.proposer.propose(ready)
            with state_lock:
                self.scheduler.propose(drafts)
        if out.is_empty:
            return outputs  # copies alone: not a step the latency model fits
        with state_lock:
            accepted = sum(v.num_accepted for v in result.verified.values())
            self.step_timings.append(StepTiming(shape, time.perf_counter() - began, now,
                                                decode_tokens=shape.decode_seqs + accepted))
            self.num_steps += 1
        return outputs

    def _store_computed_blocks(self) -> None:
        """The blocks this step filled, copied to the host prefix tier now, while the
        state lock is held (this rank's copies waited for: part of the step's time):
        until the copy ran they are pinned (no reservation can take them), and a
        request waiting for room should not wait a step for that. At
        tensor_parallel_size > 1 the other ranks run the copies before the next
        Forward, so the pins last until that step computed (Scheduler.update)."""
        bm = self.block_manager
        if not bm.has_copies:
            return
        self.runner.copy_kv(bm.take_copies(), wait=True)
        if self.config.tensor_parallel_size == 1:
            bm.release_copies()

    def _ready_for_drafts(self, out: SchedulerOutput) -> list[Request]:
        """The running requests one token behind, after the step: the proposer's.
        Preempted ones lost their KV, and what the proposer kept of them."""
        for rid in out.preempted_request_ids:
            self.proposer.forget(rid)
        # (a choice whose last block its siblings share writes there once it is its own)
        return [r for r in self.scheduler.running
                if r.num_tokens - r.num_computed_tokens == 1 and not r.shared_tail]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits [vocab] (float32) after `token_ids`, through the paged path.
        Call between steps; uses free blocks and gives them back."""
        self._prompt_token_ids(token_ids)
        request = Request("__score__", list(token_ids), SamplingParams(max_tokens=1), 0.0)
        if not self.block_manager.allocate_slots(request, len(token_ids)):
            raise RuntimeError("not enough free KV blocks to score this sequence")
        try:
            return self.runner.forward_logits([(request, len(token_ids))], [request])[0]
        finally:
            self.block_manager.free(request)

    # ---- internals ----------------------------------------------------------------

    def _new_request(self, request_id: str, prompt, params, arrival_time,
                     output_token_ids: Sequence[int] = ()) -> Request:
        """Validates everything a request carries; raises before any state changes."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        if request_id in self._tracked:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        token_ids = self._prompt_token_ids(prompt)
        bm = self.block_manager
        check_fits(len(token_ids), params.max_tokens, len(output_token_ids),
                   self.max_model_len, bm.num_blocks, bm.block_size)
        outputs = self._prompt_token_ids(list(output_token_ids)) if output_token_ids else []
        check_vocab(params, self.model_config.vocab_size)
        if 0 < self.config.scheduler.max_num_seqs < params.n:
            raise InvalidRequestError("n", f"must be at most max_num_seqs "
                                      f"({self.config.scheduler.max_num_seqs}): the choices "
                                      "run at once")
        self.prepare(params)  # a cache lookup where the worker prepared it
        arrival = time.time() if arrival_time is None else arrival_time
        return Request(request_id, token_ids, params, arrival,
                       eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                       output_token_ids=outputs)

    def _track(self, request: Request, text_sent: int = 0, resume: bool = True) -> _Tracked:
        """resume: its outputs so far were detokenized elsewhere (a moved request);
        else (a forked choice) they are to be emitted from here."""
        detokenizer = Detokenizer(self.tokenizer, request.prompt_token_ids,
                                  request.sampling_params.stop,
                                  request.sampling_params.min_tokens)
        if request.output_token_ids and resume:
            detokenizer.resume(request.output_token_ids, text_sent)
        tracked = self._tracked[request.request_id] = _Tracked(
            request, detokenizer, RequestMetrics(request.arrival_time))
        return tracked

    def _forked(self, parents: dict[str, RequestMetrics], now: float) -> list[RequestOutput]:
        """The outputs of the choices forked (n > 1) from requests at their first token
        (parents: their metrics, taken before they were reported): each tracked from
        here as a request of its own, its first token emitted."""
        outputs = []
        for parent_id, child in self.scheduler.take_forked():
            tracked = self._track(child, resume=False)
            tracked.metrics = replace(parents[parent_id], first_token_time=now)
            outputs.append(self._emit(tracked, now))
        return outputs

    def _emit(self, tracked: _Tracked, now: float, count: int = 1) -> RequestOutput:
        """The output of a request that gained `count` tokens this step."""
        request, metrics = tracked.request, tracked.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        new_ids = request.output_token_ids[-count:]
        if count == 1:
            new_text, stop = tracked.detokenizer.append(new_ids)
        else:  # a verified run, token by token: a stop string may end inside it
            new_text, stop = "", None
            for i, token in enumerate(new_ids):
                text, stop = tracked.detokenizer.append([token])
                new_text += text
                if stop is not None:
                    self.scheduler.drop_outputs(request, len(new_ids) - i - 1)
                    new_ids = new_ids[:i + 1]
                    break
        if stop is not None and not request.is_finished:
            self.scheduler.finish_requests([request.request_id], FinishReason.STOP)
        if stop is not None:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        return self._output(tracked, new_ids, new_text, now)

    def _output(self, tracked: _Tracked, new_ids: list[int], new_text: str,
                now: float) -> RequestOutput:
        request, metrics = tracked.request, tracked.metrics
        if request.is_finished:
            metrics.finished_time = now
            self._tracked.pop(request.request_id, None)
            self.runner.sampler.forget(request.request_id)
            if self.proposer is not None:
                self.proposer.forget(request.request_id)
            new_text += tracked.detokenizer.flush()
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            outputs=Outputs.of(request.output_token_ids, request.output_logprobs,
                               request.output_top_logprobs),
            text=tracked.detokenizer.emitted_text,
            new_token_ids=new_ids, new_text=new_text, finished=request.is_finished,
            metrics=metrics,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens,
            num_host_cached_tokens=request.num_host_cached_tokens, error=request.error,
            prompt_logprobs=request.prompt_logprobs, choices=request.choices)

    def _apply_aborts(self) -> list[RequestOutput]:
        ids = []
        while not self._aborts.empty():
            ids.append(self._aborts.get())
        now = time.time()
        return [self._output(self._tracked[r.request_id], [], "", now)
                for r in self.scheduler.finish_requests(ids, FinishReason.ABORT)]

    def _prompt_token_ids(self, prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)


def max_model_len_of(config: EngineConfig, model: ModelConfig) -> int:
    if config.max_model_len is None:
        return model.max_position_embeddings
    if config.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {model.max_position_embeddings}")
    return config.max_model_len
