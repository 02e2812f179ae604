"""A live migration's block ranges, checked the same way by both ends of a move on
every worker implementation (decode_worker/moves.py, pdserve/sim/moves.py): which of
a request's blocks a copy reads at its source and which it fills at its target."""
from __future__ import annotations

from typing import Callable

from pdserve.engine.block_manager import blocks_for
from pdserve.engine.errors import MoveError
from pdserve.engine.request import Request, RequestStatus
from pdserve.worker.messages import BlockCopy, IncomingCopy


def copy_end(num_computed: int, block_size: int, final: bool) -> int:
    """A live migration's copies: the blocks holding the KV of num_computed tokens,
    whole ones only while the request decodes on at its source (final: the last,
    partly filled, too)."""
    return blocks_for(num_computed, block_size) if final else num_computed // block_size


def source_blocks(request: Request | None, copy: BlockCopy, block_size: int) -> list[int]:
    """The source's blocks `copy` reads: the request running here (final: paused),
    the range within its computed blocks; MoveError otherwise."""
    wanted = RequestStatus.PAUSED if copy.final else RequestStatus.RUNNING
    if request is None or request.status is not wanted:
        raise MoveError(f"request {copy.request_id} is not {wanted.value} here")
    held = copy_end(request.num_computed_tokens, block_size, copy.final)
    last = copy.first_block + len(copy.target_blocks)
    if not 0 <= copy.first_block <= last <= held:
        raise MoveError(f"request {copy.request_id} holds {held} computed blocks here, "
                        f"not [{copy.first_block}, {last})")
    return request.block_ids[copy.first_block:last]


def target_blocks(request: Request | None, incoming: IncomingCopy, grow: Callable[[], bool],
                  block_size: int) -> list[int]:
    """The target's blocks a copy fills: the request taken over here grows by the
    tokens its source made since (grow(): False when there is no room), then its
    computed blocks from incoming.first_block on; MoveError otherwise."""
    if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
        raise MoveError(f"request {incoming.request_id} is not taken over here")
    if incoming.token_ids and not grow():
        raise MoveError(f"no room here for request {incoming.request_id}'s "
                        f"{len(incoming.token_ids)} newer tokens")
    blocks = request.block_ids[incoming.first_block:copy_end(
        request.num_tokens - 1, block_size, incoming.final)]
    if incoming.final and not blocks:
        raise MoveError(f"request {incoming.request_id}: a last copy of no block")
    return blocks
