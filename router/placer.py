"""Where a request runs: the policy's decision (policy.decide, pure) on a snapshot of
now. A refusal for want of capacity (KV, or headroom under the running requests' TPOT
SLOs) waits in the capacity queue, in deadline order, while the request's TTFT SLO
leaves time for a placement once capacity frees (and RoutingSpec.max_wait_ms in
all); any other refusal, or one with no time to wait, is the request's 429."""
from __future__ import annotations

import asyncio
import functools
import itertools
import operator
from collections.abc import Callable
from dataclasses import replace

from pdserve.engine.block_manager import blocks_for
from pdserve.engine.errors import InvalidRequestError
from pdserve.router.capacity_queue import CapacityQueue
from pdserve.router.clock import Clock
from pdserve.router.config import RouterConfig
from pdserve.router.errors import OverloadedError
from pdserve.router.lifecycle import Accepted, Flight, until
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.budget_rows import int64_priority
from pdserve.router.policy.cluster_models import ClusterModels
from pdserve.router.policy.cluster_state import ClusterState, RequestView
from pdserve.router.policy.decide import decide
from pdserve.router.policy.decision import Colocate, Decision, Reject
from pdserve.router.policy.prefix_index import block_hashes
from pdserve.router.policy.snapshot import snapshot
from pdserve.router.policy.worker_columns import ColumnsMemo
from pdserve.router.pool.pool import Pool
from pdserve.router.slo import Slo

_STATE = operator.attrgetter("state")  # a worker handle's state


class Placer:
    def __init__(self, pool: Pool, models: ClusterModels, config: RouterConfig,
                 model: ModelInfo, metrics: RouterMetrics, clock: Clock,
                 on_refused: Callable[[Reject], None]):
        """on_refused(decision): a request answered 429 (the planner counts it)."""
        self.pool, self.models, self.config = pool, models, config
        self.model, self.metrics, self.clock = model, metrics, clock
        self.on_refused = on_refused
        self.queue = CapacityQueue()
        self._placed = itertools.count()  # decisions made (round robin's sequence)
        self._columns = ColumnsMemo()

    async def place(self, flight: Flight, refused: frozenset[str]) -> Decision:
        """The request's placement, after a wait for capacity if it may wait; raises
        OverloadedError (429) when refused, InvalidRequestError (400) when its TTFT
        SLO is unattainable, lifecycle.Cancelled when aborted."""
        req = flight.req
        hashes = self.prompt_hashes(req)
        decision = self.decide(req, refused, hashes=hashes)
        if not isinstance(decision, Reject):
            self.metrics.decided(decision)
            return decision
        if decision.kind == "unattainable":  # not even an idle cluster could: 400
            self.metrics.decided(decision)
            raise InvalidRequestError("slo_ttft_ms", decision.reason)
        now = self.clock.monotonic()
        waited_s = 0.0 if flight.waited_since is None else now - flight.waited_since
        wait_s = min(self.may_wait(flight.req, decision),
                     self.config.routing.max_wait_s - waited_s)
        if wait_s <= 0:
            self.metrics.decided(decision)
            self.on_refused(decision)
            raise OverloadedError(decision.reason, decision.retry_after_s)
        self.metrics.waited.inc()
        if flight.waited_since is None:
            flight.waited_since = now
        deadline = now + wait_s
        try:
            decision = await until(flight, self.queue.wait(
                deadline, req.params.priority,
                lambda: self.decide(req, refused, hashes=hashes)), wait_s)
        except asyncio.TimeoutError:
            decision = self.decide(req, refused, hashes=hashes)  # a last look: it may fit now
        waited_s = self.clock.monotonic() - flight.waited_since
        self.metrics.decided(decision)
        if isinstance(decision, Reject):
            self.metrics.waited_out("refused", waited_s)
            self.on_refused(decision)
            raise OverloadedError(decision.reason, decision.retry_after_s)
        self.metrics.waited_out("placed", waited_s)
        # It takes its place (its load counted) before the next waiter is asked.
        self.queue.freed()
        return decision

    async def place_moved(self, flight: Flight, req: Accepted, refused: frozenset[str],
                          avoid: frozenset[str]) -> Decision:
        """Where a request moving off a failed worker (migration) goes on: `req` is it
        as it stands (its prompt and the tokens generated so far), placed best effort
        (it was admitted, and refusing it now would lose what it has), off the workers
        in `avoid` while another can take it. When none can (a dead worker's
        replacement may be starting), it waits first in line for capacity, at most
        RouterConfig.migration_wait_s; then OverloadedError."""
        req = replace(req, slo=Slo())  # judged by its own SLOs all the same (RequestTracker)
        hashes = self.prompt_hashes(req)

        def decide() -> Decision:
            decision = self.decide(req, refused, avoid, hashes)
            return self.decide(req, refused, hashes=hashes) \
                if isinstance(decision, Reject) and avoid else decision
        decision = decide()
        if isinstance(decision, Reject):
            wait_s = self.config.migration_wait_s
            try:
                decision = await until(flight, self.queue.wait(
                    self.clock.monotonic(), req.params.priority, decide), wait_s)
            except asyncio.TimeoutError:
                decision = decide()
            if isinstance(decision, Reject):
                raise OverloadedError(f"{decision.reason} (for {wait_s:g}s)",
                                      decision.retry_after_s)
            self.queue.freed()
        return decision

    @staticmethod
    def may_wait(req: Accepted, decision: Reject) -> float:
        """How long the request may wait for capacity and still meet its TTFT SLO (its
        forecast TTFT counts from its arrival, as the SLO does); 0 when it may not, or
        when the policy predicts the capacity frees too late (harm: the requests it
        would push past their SLOs end after that; tpot: its batch shrinks enough after
        that, or is not known to), so the refusal is answered at once rather than at
        its deadline."""
        if decision.kind not in ("kv", "harm", "tpot") or req.slo.ttft_s is None \
                or decision.ttft_s is None:
            return 0.0
        budget = req.slo.ttft_s - decision.ttft_s
        if decision.kind in ("harm", "tpot") and decision.retry_after_s > budget:
            return 0.0
        return budget

    def prompt_hashes(self, req: Accepted) -> Callable[[], list[bytes]]:
        """The prompt's block hashes, computed when a decision first needs them and
        then kept: a request waiting for capacity is decided again at every freeing."""
        return functools.cache(lambda: block_hashes(req.prompt_token_ids,
                                                    self.model.block_size))

    def decide(self, req: Accepted, refused: frozenset[str] = frozenset(),
               avoid: frozenset[str] = frozenset(),
               hashes: Callable[[], list[bytes]] | None = None) -> Decision:
        """The policy's decision on a snapshot of now, in which the workers in `avoid`
        take nothing new. hashes: prompt_hashes(req), where it is decided repeatedly."""
        ids, bs = req.prompt_token_ids, self.model.block_size
        cached, host_load_s = self._prefix_hits(hashes or self.prompt_hashes(req))
        view = RequestView(num_prompt_tokens=len(ids), blocks_needed=blocks_for(len(ids) + 1, bs),
                           refused=refused, slo=req.slo,
                           priority=int64_priority(req.params.priority),
                           max_tokens=req.params.max_tokens, cached_tokens=cached,
                           host_load_s=host_load_s, sequence=next(self._placed),
                           waited_s=max(self.clock.time() - req.arrival_time, 0.0))
        decision = decide(view, self.snapshot(avoid), self.config.routing.routing_policy)
        if cached and not isinstance(decision, Reject):
            computes = decision.worker if isinstance(decision, Colocate) else decision.prefill
            self.metrics.placed_prefix(cached.get(computes, 0), max(cached.values()))
        return decision

    def _prefix_hits(self, hashes: Callable[[], list[bytes]]
                     ) -> tuple[dict[str, int], dict[str, float]]:
        """Worker -> the prompt's leading tokens it holds, on its device or after that
        in its host tier (as its block manager looks: the device first, then the host
        tier from where the device's hits end), and the seconds loading the host
        part takes there."""
        models = self.models
        if not self.config.routing.prefix_aware or not (models.prefixes or models.host_prefixes):
            return {}, {}
        bs, prompt = self.model.block_size, hashes()
        device = models.prefixes.hits(prompt) if models.prefixes else {}
        host = models.host_prefixes.hits(prompt) if models.host_prefixes else {}
        cached = {w: n * bs for w, n in device.items()}
        load_s: dict[str, float] = {}
        for w, n in host.items():
            extra = n - device.get(w, 0)
            if extra > 0:
                cached[w] = n * bs
                load_s[w] = extra * models.host_load_s.get(w, 0.0)
        return cached, load_s

    def snapshot(self, avoid: frozenset[str] = frozenset()) -> ClusterState:
        """Every worker's state now, as the policy sees it, with the TPOT budgets of
        this router's requests running on each; those in `avoid` as if draining."""
        workers = self.pool.workers
        states = tuple(map(_STATE, workers.values())) if not avoid else tuple(
            replace(w.state, draining=True) if w.worker_id in avoid else w.state
            for w in workers.values())
        return snapshot(states, workers,
                        self.clock.monotonic(), self.clock.time(), self.config, self.model,
                        self.models.transfer_costs, self._columns)
