"""Live migration on a simulated worker (decode_worker/moves.py's calls, in virtual
time, over the production Scheduler): copies take the profile's transfer time and move
the KV of a model-backed token source; a copy into a target that no longer expects it,
or of blocks that changed under it, fails as a real one does."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pdserve.engine.errors import InvalidRequestError, MoveError
from pdserve.engine.request import RequestStatus
from pdserve.engine.worker_messages import BlockCopy, Job, Paused, Reservation, TokenDelta

if TYPE_CHECKING:
    from pdserve.sim.worker import SimWorker


class SimMoves:
    """A SimWorker's part (it reads and changes the worker's own state)."""

    def __init__(self, worker: "SimWorker"):
        self.worker = worker
        self.expected: dict[str, tuple[str, list[int]]] = {}  # transfer -> (request, blocks)

    async def take_over(self, job: Job, subscriber: str) -> Reservation | None:
        w = self.worker
        rid = job.request_id
        if rid in w._aborted:
            return None  # its abort overtook this call
        if rid in w._owners:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use on this worker")
        request = w._request(rid, job.prompt_token_ids, job.sampling_params,
                                job.arrival_time, job.output_token_ids)
        w._cut()  # the blocks a stretch in flight took are taken
        if not w.scheduler.reserve(request):
            return None
        w._owners[rid] = subscriber
        cached = request.num_cached_tokens // w.blocks.block_size
        return Reservation(request_id=rid, receiver_address=w.worker_id,
                           block_ids=list(request.block_ids), num_cached_blocks=cached)

    def expect_copy(self, request_id: str, transfer_id: str, block_ids: list[int]) -> None:
        request = self.worker.scheduler.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
            raise MoveError(f"request {request_id} is not taken over here")
        if not set(block_ids) <= set(request.block_ids):
            raise MoveError(f"blocks {block_ids} are not request {request_id}'s")
        self.expected[transfer_id] = (request_id, list(block_ids))

    async def send_blocks(self, copy: BlockCopy) -> int:
        w = self.worker
        w._cut()
        request = w.scheduler.requests.get(copy.request_id)
        wanted = RequestStatus.PAUSED if copy.final else RequestStatus.RUNNING
        if request is None or request.status is not wanted:
            raise MoveError(f"request {copy.request_id} is not {wanted.value} here")
        bs, computed = w.blocks.block_size, request.num_computed_tokens
        held = -(-computed // bs) if copy.final else computed // bs
        last = copy.first_block + len(copy.target_blocks)
        if not 0 <= copy.first_block <= last <= held:
            raise MoveError(f"request {copy.request_id} holds {held} computed blocks here, "
                            f"not [{copy.first_block}, {last})")
        src, preemptions = request.block_ids[copy.first_block:last], request.num_preemptions
        nbytes = len(src) * w.profile.kv_bytes_per_block
        await asyncio.sleep(w.profile.transfer_cost.seconds(nbytes))
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
        del peer.moves.expected[copy.transfer_id]
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

    def grow(self, request_id: str, token_ids: list[int]) -> list[int]:
        w = self.worker
        w._cut()
        if not w.scheduler.grow(request_id, token_ids):
            raise MoveError(f"no room here for request {request_id}'s {len(token_ids)} "
                            "newer tokens")
        return list(w.scheduler.requests[request_id].block_ids)

    async def resume(self, request_id: str) -> None:
        w = self.worker
        resumed = asyncio.get_running_loop().create_future()

        def resume() -> None:
            try:
                w.scheduler.resume_moved(request_id)
            except (KeyError, ValueError) as exc:  # aborted meanwhile
                resumed.set_exception(MoveError(f"{request_id} cannot resume: {exc}"))
                return
            w._last_token_at[request_id] = w._now  # the router has its tokens so far
            resumed.set_result(None)
        w._at_boundary(resume)
        await resumed
