"""Live migration, the decode side of both ends: a running request's KV copied to
another decode-capable worker while it keeps decoding here, then a short pause for the
last copy. The router drives it (router/live_move.py):

    target.take_over(job)           blocks for the request as it stands (no transfer
                                    expected yet; its own prefix hits are not sent)
    target.expect_copy(incoming) + source.send_blocks(copy)
                                    whole blocks, while the source decodes on; again
                                    for those filled meanwhile (the target grows by the
                                    tokens made since, as the router saw them)
    source.pause(id)                out of the batch at the next step boundary, KV kept;
                                    a last delta marked `paused` follows its tokens on
                                    the step stream
    target.expect_copy(final) + source.send_blocks(final copy)
                                    the tokens made since, and the rest of the KV, its
                                    last block partly filled; it decodes on there once
                                    the copy landed; the source's copy is aborted

Each copy is a kv_transfer of its own (BlockCopy.transfer_id), on the lane this
worker uses for that peer; between tensor-parallel workers every rank copies its own
KV heads (prefill_worker/destination.py), and a last copy has landed once it did on
every rank of the target. A copy of blocks that changed under it (the request was
preempted meanwhile, and its blocks reused) fails, so the router falls back to replay."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import MoveError
from pdserve.engine.move_blocks import source_blocks, target_blocks
from pdserve.kv_transfer import KVReceiver
from pdserve.worker.messages import BlockCopy, IncomingCopy, Paused, TokenDelta

# send(transfer_id, address, source blocks, target blocks, urgent) -> Future of the
# bytes sent (urgent: a paused request's last copy, before the copies queued)
Send = Callable[[str, str, list[int], list[int], bool], Future]


class Moves:
    def __init__(self, loop: EngineLoop, receiver: KVReceiver, send: Send,
                 publish: Callable[[list[TokenDelta]], None], links: tuple = (),
                 release: Callable[[str], None] | None = None):
        """links: ranks 1.. of a tensor-parallel worker (worker/rank_kv.py); release:
        as DecodeRole's."""
        self.loop, self.receiver, self.send, self.publish = loop, receiver, send, publish
        self.links = links
        self.release = release or (lambda request_id: self.loop.engine.abort(request_id))

    # ---- the source ------------------------------------------------------------------

    def send_blocks(self, copy: BlockCopy) -> Future:
        """Sends blocks of a request running (or, final, paused) here; resolves to the
        bytes sent once they landed."""
        def read(engine: LLMEngine) -> tuple[list[int], int]:
            request = engine.scheduler.requests.get(copy.request_id)
            src = source_blocks(request, copy, engine.block_manager.block_size)
            return src, request.num_preemptions

        src, preemptions = self.loop.call_concurrent(read)
        sent: Future = Future()

        def checked(transfer: Future) -> None:
            if transfer.exception() is not None:
                sent.set_exception(transfer.exception())
            elif not copy.final and self.loop.call_concurrent(
                    lambda engine: _preempted_since(engine, copy.request_id, preemptions)):
                sent.set_exception(MoveError(f"request {copy.request_id} was preempted (or "
                                             "ended) while its blocks were copied"))
            else:
                sent.set_result(transfer.result())
        self.send(copy.transfer_id, copy.target_address, src, copy.target_blocks,
                  copy.final).add_done_callback(checked)
        return sent

    def pause(self, request_id: str) -> Future:
        """At the next step boundary: out of the batch, KV kept; resolves to Paused, or
        None when it is not running here (finished meanwhile). Its marker delta goes
        out on the engine thread, after every token of its earlier steps."""
        def pause(engine: LLMEngine) -> Paused | None:
            paused = engine.pause(request_id)
            if paused is not None:
                self.publish([TokenDelta(request_id=request_id, token_ids=[], text="",
                                         logprobs=[], finished=False, paused=True)])
            return paused
        return self.loop.call(pause)

    # ---- the target ------------------------------------------------------------------

    def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        """The request grows by the tokens its source made since (their text sent up to
        incoming.text_sent), and a copy of its whole computed blocks from
        incoming.first_block on (final: all of them, the last partly filled) is
        expected as incoming.transfer_id; returns those blocks. Final: once the copy
        lands, the request joins the batch at the next step boundary."""
        def expect(engine: LLMEngine) -> list[int]:
            blocks = target_blocks(
                engine.scheduler.requests.get(incoming.request_id), incoming,
                lambda: engine.grow(incoming.request_id, incoming.token_ids,
                                    incoming.text_sent),
                engine.block_manager.block_size)
            if blocks:
                self.receiver.expect(incoming.transfer_id, blocks, 0)
                try:  # every rank's heads land in the same blocks
                    for link in self.links:
                        link.expect(incoming.transfer_id, blocks, 0, incoming.final)
                except BaseException:
                    self.receiver.abort(incoming.transfer_id)
                    raise
            return blocks
        blocks = self.loop.call_concurrent(expect)
        if not blocks:
            return blocks
        landed = self.receiver.landed(incoming.transfer_id)  # forgotten once it landed
        if incoming.final:
            landed.add_done_callback(lambda done: done.exception() is None
                                     and self._landed_everywhere(incoming))
        return blocks

    def _landed_everywhere(self, incoming: IncomingCopy) -> None:
        """Rank 0's part landed: the request resumes once every other rank's did (on a
        thread of its own: a rank's answer is a network wait)."""
        if not self.links:
            self._resume(incoming.request_id)
            return

        def wait() -> None:
            timeout_s = self.receiver.config.timeout_s
            for link in self.links:
                try:
                    link.wait_landed(incoming.transfer_id, timeout_s).check(
                        incoming.transfer_id)
                except Exception as exc:
                    self.release(incoming.transfer_id)  # the copy ends on every rank
                    self.release(incoming.request_id)
                    self.publish([TokenDelta.not_resumed(incoming.request_id, exc)])
                    return
            self._resume(incoming.request_id)
        threading.Thread(target=wait, daemon=True, name="kv-copy-landed").start()

    def _resume(self, request_id: str) -> None:
        """Into the batch at the next step boundary; one that cannot be is freed, and
        its stream's last delta tells the router to place it again."""
        def resume(engine: LLMEngine) -> None:
            if request_id not in engine.scheduler.requests:  # aborted meanwhile
                return
            try:
                engine.resume_moved(request_id)
            except Exception as exc:
                engine.abort(request_id)
                self.publish([TokenDelta.not_resumed(request_id, exc)])
        self.loop.call(resume)


def _preempted_since(engine: LLMEngine, request_id: str, preemptions: int) -> bool:
    request = engine.scheduler.requests.get(request_id)
    return request is None or request.num_preemptions != preemptions
