"""The round-robin policy (--routing-policy round-robin), pure: the request's
sequence number picks the next worker in each pool (prefill workers whose queue has
room; decode-capable workers that did not refuse it), knowing nothing of load."""
from __future__ import annotations

from pdserve.router.policy.cluster_state import ClusterState, RequestView
from pdserve.router.policy.decision import Colocate, Decision, Disaggregate, Reject
from pdserve.router.policy.least_loaded import has_room


def decide(request: RequestView, state: ClusterState) -> Decision:
    live = sorted((w for w in state.workers if w.available), key=lambda w: w.worker_id)
    decoders = [w for w in live if w.decodes and w.worker_id not in request.refused]
    if not any(w.role == "prefill" for w in live):
        both = [w for w in decoders if w.role == "both"]
        if not both:
            return Reject("no engine worker can take this request", state.retry_after_s)
        return Colocate(both[request.sequence % len(both)].worker_id)
    prefill = [w for w in live if w.role == "prefill" and has_room(w, request, state)]
    if not prefill or not decoders:
        return Reject("no prefill or decode worker can take this request",
                      state.retry_after_s)
    return Disaggregate(prefill[request.sequence % len(prefill)].worker_id,
                        decoders[request.sequence % len(decoders)].worker_id)
