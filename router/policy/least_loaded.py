"""The least-loaded policy (--routing-policy least-loaded), pure: load balancing with
no latency model and no SLOs: colocate on the least-loaded worker of role both when
the cluster has no prefill worker; otherwise disaggregate onto the prefill worker
with the fewest queued prompt tokens whose queue has room, and the decode-capable
worker with the fewest requests in flight, then the most free KV (as last reported;
a stale report is unknown). Draining, dead and stalled workers take nothing new."""
from __future__ import annotations

from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState
from pdserve.router.policy.decision import Colocate, Decision, Disaggregate, Reject


def decide(request: RequestView, state: ClusterState) -> Decision:
    pool = [w for w in state.workers if w.role == "prefill"]
    if not pool:
        return _colocate(request, state)
    prefill = [w for w in pool if w.available]
    if not prefill:
        return Reject("no prefill worker is in service", state.retry_after_s)
    room = [w for w in prefill if has_room(w, request, state)]
    if not room:
        return Reject("every prefill worker's queue is full", state.retry_after_s)
    decode = _best_decode(request, state, [w for w in state.workers
                                           if w.available and w.decodes])
    if decode is None:
        return Reject("no decode worker has room for this request's KV",
                      state.retry_after_s)
    chosen = min(room, key=lambda w: (w.all_queued_tokens, w.all_queued, w.worker_id))
    return Disaggregate(chosen.worker_id, decode.worker_id)


def _colocate(request: RequestView, state: ClusterState) -> Decision:
    best = _best_decode(request, state, [w for w in state.workers
                                         if w.available and w.role == "both"])
    if best is None:
        return Reject("no engine worker has room for this request", state.retry_after_s)
    return Colocate(best.worker_id)


def _best_decode(request: RequestView, state: ClusterState,
                 workers: list[WorkerState]) -> WorkerState | None:
    """Fewest in flight, then most free KV; workers that refused this request are not
    asked again. One that lacked room when last heard from ranks last rather than
    being skipped: that figure is stale by the time it is read, and asking costs one
    refusal."""
    def rank(w: WorkerState):
        free = state.free_blocks(w)
        short = free is not None and free < request.blocks_needed
        return (short, w.all_inflight, -(free or 0), w.worker_id)
    return min((w for w in workers if w.worker_id not in request.refused), key=rank,
               default=None)


def has_room(w: WorkerState, request: RequestView, state: ClusterState) -> bool:
    """An empty queue always has room: one long prompt must not be refused forever."""
    limit = state.max_queued_prefill_tokens
    return (not limit or w.all_queued == 0
            or w.all_queued_tokens + request.num_prompt_tokens <= limit)
