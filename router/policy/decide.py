"""The one decision point: `decide(request, ClusterState, policy) -> Decision`, pure
(no I/O, no Ray, no clock). The router calls it for every request, and again only
when a worker it chose refused (the refusal is news the next snapshot carries).
The policies (--routing-policy) share the signature: goodput (the latency model
and the request's SLOs; goodput.py), least-loaded and round-robin."""
from __future__ import annotations

from pdserve.router.config import POLICIES as NAMES
from pdserve.router.policy import goodput, least_loaded, round_robin
from pdserve.router.policy.cluster_state import ClusterState, RequestView
from pdserve.router.policy.decision import Decision

POLICIES = {"goodput": goodput.decide, "least-loaded": least_loaded.decide,
            "round-robin": round_robin.decide}
assert tuple(POLICIES) == NAMES, "RoutingSpec's choices are the policies here"


def decide(request: RequestView, state: ClusterState, policy: str = "goodput") -> Decision:
    return POLICIES[policy](request, state)
