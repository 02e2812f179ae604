"""A prefill worker: runs prompts (batched, chunked, prefix-cached) and streams each
request's KV layer by layer to the decode worker the router chose.

Job lifecycle: prefill() queues the prompt (max_tokens=1) -> the step that computes
its last prompt chunk begins the transfer and sends each layer as the forward pass
writes it -> the first token is sampled -> the decode worker confirms every layer
landed -> the PrefillResult resolves. Any transfer error resolves it with that error.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.worker_messages import PrefillJob, PrefillResult
from pdserve.kv_transfer import KVSender, SendHandle, TransferConfig


@dataclass
class _Job:
    job: PrefillJob
    future: Future
    handle: SendHandle | None = None


class PrefillWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig,
                 transfer: TransferConfig = TransferConfig()):
        self.worker_id = worker_id
        engine = LLMEngine(engine_config)
        self.sender = KVSender(worker_id, engine.runner.kv_caches, transfer)
        self._jobs: dict[str, _Job] = {}
        # Waiting for a receiver's confirmation must not stall the engine loop.
        self._confirm = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-confirm")
        self.loop = EngineLoop(engine, on_step=self._on_step, export=self._export)

    def prefill(self, job: PrefillJob) -> Future:
        """Resolves to a PrefillResult once the KV landed on the decode worker."""
        future: Future = Future()
        # Only the first token is sampled here; stop conditions are the decode side's.
        params = replace(job.sampling_params, max_tokens=1, stop=(), stop_token_ids=(),
                         ignore_eos=True)

        def add(engine: LLMEngine) -> None:
            engine.add_request(job.request_id, job.prompt_token_ids, params, job.arrival_time)
            self._jobs[job.request_id] = _Job(job, future)

        def refused(added: Future) -> None:  # bad input: the engine raised, nothing queued
            if added.exception() is not None and not future.done():
                future.set_exception(added.exception())

        self.loop.call(add).add_done_callback(refused)
        return future

    def connect(self, receiver_addresses: list[str]) -> None:
        """Pair with decode workers now rather than on their first request."""
        for address in receiver_addresses:
            self.sender.connect(address)

    def abort(self, request_id: str) -> None:
        self.loop.engine.abort(request_id)
        entry = self._jobs.get(request_id)
        if entry is not None and entry.handle is not None:
            self._confirm.submit(self.sender.abort, entry.handle)

    def stats(self) -> dict:
        engine = self.loop.engine
        return {"worker_id": self.worker_id, "waiting": len(engine.scheduler.waiting),
                "running": len(engine.scheduler.running),
                "free_blocks": engine.block_manager.num_free_blocks,
                "num_blocks": engine.block_manager.num_blocks}

    def shutdown(self) -> None:
        self.loop.stop()
        self._confirm.shutdown(wait=False)
        self.sender.close()

    # ---- on the engine thread ---------------------------------------------------

    def _export(self, out: SchedulerOutput):
        started = []
        for request, n in zip(out.requests, out.num_scheduled):
            entry = self._jobs.get(request.request_id)
            if entry is None or request.num_computed_tokens + n != request.num_tokens:
                continue  # not ours, or not the prompt's last chunk yet
            target = entry.job.target
            try:
                entry.handle = self.sender.begin(request.request_id, target.receiver_address,
                                                 request.block_ids, target.block_ids,
                                                 target.num_cached_blocks)
            except Exception as exc:
                self._resolve(request.request_id, error=exc)
                continue
            started.append(entry.handle)
        if not started:
            return None

        def send(layer: int) -> None:
            for handle in started:
                try:
                    self.sender.send_layer(handle, layer)
                except Exception as exc:  # one lost peer fails its request, not the step
                    self._resolve(handle.request_id, error=exc)

        return send

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._jobs.get(out.request_id)
            if entry is None or not out.finished:
                continue
            if entry.handle is None or out.finish_reason == "abort":
                self._resolve(out.request_id, error=RuntimeError(
                    f"request {out.request_id} was aborted before its KV was sent"))
                continue
            self._confirm.submit(self._await_receiver, entry, out)

    def _await_receiver(self, entry: _Job, out: RequestOutput) -> None:
        try:
            handle = self.sender.finish(entry.handle)
        except Exception as exc:
            self._resolve(out.request_id, error=exc)
            return
        started = out.metrics.first_scheduled_time or out.metrics.arrival_time
        self._resolve(out.request_id, result=PrefillResult(
            out.request_id, out.token_ids[0], out.logprobs[0] if out.logprobs else None,
            out.top_logprobs[0] if out.top_logprobs else None,
            handle.bytes_sent, time.time() - started))

    def _resolve(self, request_id: str, result=None, error=None) -> None:
        entry = self._jobs.pop(request_id, None)
        if entry is None or entry.future.done():
            return
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(result)
