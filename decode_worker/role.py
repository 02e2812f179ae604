"""The decode role of a worker: reserves KV blocks for the router, imports each
prompt's KV from a prefill worker, runs the requests in its continuous batch and
turns every step's new tokens into TokenDeltas. In role both the same worker is
handed whole requests (submit) and prefills them itself with chunked prefill.

Request lifecycle: reserve() (blocks held, receiver expecting) -> start(first token)
once the prefill worker reports the KV landed -> decoding in the batch (preemption
recomputes locally) -> finished. An abort, a failed transfer or an expired lease (the
receiver's) frees the blocks. An abort may overtake the reservation it cancels: the
id is remembered for a while and a later reserve() of it is refused.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.outputs import RequestOutput
from pdserve.kv_transfer import KVReceiver
from pdserve.worker.core import WorkerCore
from pdserve.worker.messages import Job, Reservation, TokenDelta


class DecodeRole:
    """Hosted by a Worker (worker/worker.py). `publish(deltas)` sends deltas that
    arise outside a step (a started request's first token) on the engine thread."""

    def __init__(self, loop: EngineLoop, receiver: KVReceiver, core: WorkerCore,
                 publish: Callable[[list[TokenDelta]], None], links: tuple = (),
                 release: Callable[[str], None] | None = None):
        """core: its worker's; the aborts it remembers (read and written under the
        engine's state lock). links: ranks 1.. of a tensor-parallel worker
        (worker/rank_kv.py), each receiving its own KV heads into the same blocks;
        release(request_id): ends its KV's landing on those ranks, then frees its
        blocks (the engine's abort, without ranks)."""
        self.loop = loop
        self.receiver = receiver
        self.links = links
        self.release = release or (lambda request_id: self.loop.engine.abort(request_id))
        self.core = core
        self.publish = publish
        self._reserving = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reserve")

    @property
    def address(self) -> str:
        return self.receiver.address

    def reserve(self, job: Job, expect: bool = True) -> Future:
        """Resolves to a Reservation, or None when the KV pool has no room. Runs beside
        the decode step in flight rather than after it: waiting for the step boundary
        would add up to a whole decode step to the request's TTFT. expect=False: no
        transfer of the whole is expected (a live migration copies it in parts:
        moves.py)."""
        def reserve(engine: LLMEngine) -> Reservation | None:
            if self.core.overtaken(job.request_id):
                return None  # its abort overtook this call
            request = engine.reserve_remote(job.request_id, job.prompt_token_ids,
                                            job.params_here(False), job.arrival_time,
                                            output_token_ids=job.output_token_ids,
                                            text_sent=job.text_sent)
            if request is None:
                return None
            cached = request.num_cached_tokens // engine.block_manager.block_size
            if expect:
                self.receiver.expect(job.request_id, request.block_ids[cached:], cached)
                try:  # every rank expects it before any sender hears of the blocks
                    for link in self.links:
                        link.expect(job.request_id, request.block_ids[cached:], cached)
                except BaseException:
                    self.receiver.abort(job.request_id)  # released: the blocks go back
                    raise
            return Reservation(request_id=job.request_id, receiver_address=self.address,
                               block_ids=list(request.block_ids), num_cached_blocks=cached)

        return self._reserving.submit(self.loop.call_concurrent, reserve)

    def submit(self, job: Job) -> Future:
        """Colocated mode: run the whole request here, prefill (chunked) included."""
        return self.loop.call(lambda engine: engine.add_request(
            job.request_id, job.prompt_token_ids, job.params_here(True), job.arrival_time,
            output_token_ids=job.output_token_ids, text_sent=job.text_sent,
            ttft_slo_s=job.ttft_slo_s) and None)

    def start(self, request_id: str, first_token: int, choices: Sequence[int] = ()) -> Future:
        """The prefill worker sent the KV and sampled `first_token`: once the KV is
        confirmed here, the request joins the batch at the next step boundary. Resolves
        then, or with the transfer's typed error. No thread waits: many starts arriving
        together all join at the same boundary."""
        started: Future = Future()

        def join(engine: LLMEngine) -> None:
            # Published on the engine thread, so it precedes the request's next step.
            self.publish(deltas(engine.admit_remote(request_id, first_token, choices)))

        def landed(transfer: Future) -> None:
            if transfer.exception() is not None:
                started.set_exception(transfer.exception())
            else:
                _chain(self.loop.call(join), started)

        try:
            self.receiver.landed(request_id).add_done_callback(landed)
        except KeyError as exc:
            started.set_exception(exc)
        return started

    def abort(self, request_id: str) -> None:
        """Frees whatever the request holds here, now or once a reservation in flight
        lands. Atomic with reserve(): both run under the engine's state lock."""
        def abort(engine: LLMEngine) -> None:
            self.core.aborted(request_id)
            self.receiver.abort(request_id)
            self.release(request_id)  # on every rank before its blocks are free again
        self.loop.call_concurrent(abort)

    def shutdown(self) -> None:
        self._reserving.shutdown(wait=False)


def deltas(outputs: list[RequestOutput]) -> list[TokenDelta]:
    """What a step's outputs tell the router: each request's new tokens and text."""
    return [TokenDelta(request_id=o.request_id, token_ids=o.new_token_ids, text=o.new_text,
                       logprobs=o.new_logprobs, finished=o.finished,
                       finish_reason=o.finish_reason,
                       num_prompt_tokens=len(o.prompt_token_ids),
                       num_cached_tokens=o.num_cached_tokens,
                       num_host_cached_tokens=o.num_host_cached_tokens,
                       num_output_tokens=o.num_output_tokens,
                       top_logprobs=o.new_top_logprobs, error=o.error,
                       # sent once, with the first token (not again for a moved one)
                       prompt_logprobs=o.prompt_logprobs
                       if o.new_token_ids and o.num_output_tokens == len(o.new_token_ids)
                       else None)
            for o in outputs]


def _chain(source: Future, target: Future) -> None:
    source.add_done_callback(lambda f: target.set_exception(f.exception())
                             if f.exception() is not None else target.set_result(f.result()))


def abort_on_ranks(links, request_id: str) -> None:
    """The request's KV stops landing on every other rank; raises the first failure
    (a rank that cannot say so may still write into the request's blocks) once every
    rank was asked."""
    failure = None
    for link in links:
        try:
            link.abort_expected(request_id)
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
