"""Live migration on a simulated worker (decode_worker/moves.py's calls, in virtual
time, over the production Scheduler): copies take the profile's transfer time and move
the KV of a model-backed token source; a copy into a target that no longer expects it,
or of blocks that changed under it, fails as a real one does."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pdserve.engine.errors import MoveError
from pdserve.engine.move_blocks import source_blocks, target_blocks
from pdserve.worker.messages import BlockCopy, IncomingCopy, Paused, TokenDelta

if TYPE_CHECKING:
    from pdserve.sim.worker import SimWorker


class SimMoves:
    """A SimWorker's part (it reads and changes the worker's own state)."""

    def __init__(self, worker: "SimWorker"):
        self.worker = worker
        # transfer id -> (request id, final): the copies expected here
        self.expected: dict[str, tuple[str, bool]] = {}

    def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        w = self.worker
        w._cut()
        blocks = target_blocks(
            w.scheduler.requests.get(incoming.request_id), incoming,
            lambda: w.scheduler.grow(incoming.request_id, incoming.token_ids),
            w.blocks.block_size)
        if blocks:
            self.expected[incoming.transfer_id] = (incoming.request_id, incoming.final)
        return list(blocks)

    async def send_blocks(self, copy: BlockCopy) -> int:
        w = self.worker
        w._cut()
        request = w.scheduler.requests.get(copy.request_id)
        src = source_blocks(request, copy, w.blocks.block_size)
        preemptions = request.num_preemptions
        nbytes = len(src) * w.profile.kv_bytes_per_block
        await asyncio.sleep(w.transfer_seconds(nbytes, w.peers.get(copy.target_address)))
        peer = w.peers.get(copy.target_address)
        if peer is None or not peer.alive or copy.transfer_id not in peer.moves.expected:
            raise MoveError(f"{copy.target_address} does not expect {copy.transfer_id}")
        if not w.alive:
            raise MoveError(f"worker {w.worker_id} died during the copy")
        after = w.scheduler.requests.get(copy.request_id)
        if after is None or after.num_preemptions != preemptions:
            raise MoveError(f"request {copy.request_id} was preempted (or ended) while its "
                            "blocks were copied")
        # Whole blocks do not change while it decodes on; the last one is copied only
        # once it is paused: the KV as of now is the KV as of the copy's start.
        w.tokens.copy_kv(src, peer.tokens, copy.target_blocks)
        request_id, final = peer.moves.expected.pop(copy.transfer_id)
        if final:
            peer.moves._resume(request_id)
        return nbytes

    async def pause(self, request_id: str) -> Paused | None:
        w = self.worker
        paused = asyncio.get_running_loop().create_future()

        def pause() -> None:
            request = w.scheduler.pause(request_id)
            if request is None:
                paused.set_result(None)
                return
            w._publish([TokenDelta(request_id=request_id, token_ids=[], text="", logprobs=[],
                                  finished=False, paused=True)])
            paused.set_result(Paused(request_id=request_id,
                                     output_token_ids=list(request.output_token_ids),
                                     text_sent=0,  # text is not simulated
                                     num_computed_tokens=request.num_computed_tokens))
        w._at_boundary(pause)
        return await paused

    def forget(self, request_id: str) -> None:
        """The request was aborted here: a copy into its blocks, freed, fails."""
        for transfer_id in [t for t, (rid, _) in self.expected.items() if rid == request_id]:
            del self.expected[transfer_id]

    def _resume(self, request_id: str) -> None:
        """The target: its KV is in; it decodes on from the next step boundary."""
        w = self.worker

        def resume() -> None:
            if request_id not in w.scheduler.requests:  # aborted meanwhile
                return
            try:
                w.scheduler.resume_moved(request_id)
            except Exception as exc:  # freed; the router places it again
                w._publish([TokenDelta.not_resumed(request_id, exc)])
                w._finish_aborted(request_id)  # its owner forgotten: no second delta
                return
            w._last_token_at[request_id] = w._now  # the router has its tokens so far
        w._at_boundary(resume)
