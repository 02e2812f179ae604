"""The steady batch: every running request one token behind (a decode), nothing
waiting, the batch as the last update left it. Beside the scheduler, which holds one
while the batch stays steady:

- `SteadyBatch.schedule`: the batch taken whole, only the requests entering a new
  block looked at (what the general path would schedule, in an order that cannot
  matter: every running request is in it);
- `SteadyBatch.update`: its sampled tokens appended in one tight loop; only the
  requests that complete a block or may stop go on to the scheduler's rules.

And the simulator's multi-step decode over a scheduler (pdserve/sim/worker.py):
`steps_ahead` (how many steps from now stay steady) and `advance` (that many steps at
once), equal to as many rounds of schedule() and update() (tests/engine/
test_scheduler.py). A production engine runs a step at a time."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


class SteadyBatch:
    """The running requests, all decoding, and which of them need a block next."""

    def __init__(self, requests: list[Request], block_manager: BlockManager):
        self.requests = requests
        self._bm = block_manager
        bs = block_manager.block_size
        self._short = [r for r in requests if len(r.block_ids) * bs <= r.num_computed_tokens]

    @classmethod
    def after(cls, out: SchedulerOutput, running: list[Request],
              block_manager: BlockManager) -> SteadyBatch | None:
        """The batch a general step left, when every running request was scheduled and
        is now one token behind; else None."""
        if out.num_running != len(out.requests) or any(
                r.num_tokens - r.num_computed_tokens != 1 or r.num_choices > 1
                for r in out.requests):
            return None  # (a request for n > 1 one token short forks at its next one)
        return cls(list(running), block_manager)

    def holds(self, running: list[Request], waiting: list[Request], budget: int) -> bool:
        """Still the batch: nothing waiting, within the budget, unchanged (`==` compares
        identities first: a few us for hundreds)."""
        return not waiting and len(self.requests) <= budget and running == self.requests

    def schedule(self) -> SchedulerOutput | None:
        """One token for each; None when a block is short (the general path preempts)."""
        append_block = self._bm.append_block
        for request in self._short:
            if not append_block(request):
                return None
        self._short = []
        n = len(self.requests)
        return SchedulerOutput(requests=list(self.requests), num_scheduled=[1] * n,
                               total_num_scheduled_tokens=n, num_running=n, steady=True)

    def update(self, running: list[Request], sampled: dict[str, int]
               ) -> tuple[int, list[Request]]:
        """Each request's token appended (Request.append_output inlined): how many
        were, and those that completed a block (now cached) or may have stopped (a
        stop token, or at their length: Request.check_stop decides), for the
        scheduler's rules. It sets the batch again once they are applied (`requests`)."""
        requests = self.requests
        bs = self._bm.block_size
        if running != requests:  # changed since schedule(): one finished, or joined
            requests = [r for r in requests if r.status is RequestStatus.RUNNING]
        events = []
        for request in requests:
            token = sampled[request.request_id]
            request.output_token_ids.append(token)
            computed = request.num_computed_tokens = request.num_computed_tokens + 1
            request.num_tokens = computed + 1
            if computed % bs and computed + 1 < request.max_num_tokens \
                    and token not in request.stop_token_set:
                continue
            events.append(request)
        self._bm.cache_decoded_blocks([r for r in events if not r.num_computed_tokens % bs])
        return len(requests), events

    def going_on(self, request: Request) -> None:
        """A returned request that did not stop: its next token may need a block."""
        if len(request.block_ids) * self._bm.block_size <= request.num_computed_tokens:
            self._short.append(request)

    def __len__(self) -> int:
        return len(self.requests)


def steps_ahead(scheduler: Scheduler) -> int:
    """How many steps from now would be the same batch decoding one token each:
    nothing waiting, every running request one token behind with no stop token or
    logprobs to check, none reaching its end, and KV blocks free for every token."""
    running = scheduler.running
    if scheduler.waiting or scheduler.swapped or not running \
            or len(running) > scheduler.config.max_num_batched_tokens:
        return 0
    steps = None
    for r in running:
        if r.num_tokens - r.num_computed_tokens != 1 or r.stop_token_set \
                or r.sampling_params.logprobs:
            return 0
        left = r.max_num_tokens - r.num_tokens - 1  # the last one is a step of its own
        steps = left if steps is None else min(steps, left)
    bm = scheduler.block_manager
    free = bm.num_free_blocks
    # The most steps whose new blocks fit: new blocks grow with the steps.
    low, high = 0, max(steps, 0)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(_blocks_short(bm, r, mid) for r in running) <= free:
            low = mid
        else:
            high = mid - 1
    return low


def advance(scheduler: Scheduler, steps: int,
            tokens: Callable[[Request, int], list[int]]) -> None:
    """`steps` steady decode steps at once (at most steps_ahead()): each request gets
    tokens(request, steps) as its next tokens."""
    bm = scheduler.block_manager
    for r in scheduler.running:
        if _blocks_short(bm, r, steps):
            bm.allocate_slots(r, steps)
        r.extend_output(tokens(r, steps))
        r.num_computed_tokens += steps
        bm.cache_full_blocks(r, r.num_computed_tokens)
    scheduler.stats.generation_tokens += steps * len(scheduler.running)


def _blocks_short(bm: BlockManager, request: Request, steps: int) -> int:
    """The blocks `steps` more decode steps of the request need beyond its own."""
    return max(0, bm.blocks_needed(request.num_computed_tokens + steps) - len(request.block_ids))
