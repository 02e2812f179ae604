"""Whether a cluster's nodes can hold the workers asked for, checked before any actor
is created: Ray would otherwise leave an actor it cannot place pending forever, and
`pdserve serve` would wait silently. Pure (node capacities in, a reason out); the
wait for nodes still joining takes its clock and its reads as arguments."""
from __future__ import annotations

import time
from typing import Callable


class PlacementError(RuntimeError):
    """The cluster cannot hold the workers asked for (or did not place them in time)."""


def unplaceable(workers: dict[str, dict[str, float]], nodes: list[dict[str, float]]
                ) -> str | None:
    """`workers`: each worker's resource demand by name ({"CPU": 1, "GPU": 1, ...});
    `nodes`: each live node's total resources. None when every worker fits on some
    node at once (first fit, largest demands first), else what does not fit and
    what the nodes have."""
    free = [dict(node) for node in nodes]
    order = sorted(workers.items(), key=lambda item: sorted(item[1].items()), reverse=True)
    for name, demand in order:
        node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in demand.items())),
                    None)
        if node is None and len(workers) == 1:
            return (f"Ray cannot place {name} ({fmt_resources(demand)}): no node has that "
                    f"much; the cluster's {len(nodes)} node(s) have "
                    + "; ".join(fmt_resources({k: v for k, v in n.items() if k in demand})
                                for n in nodes) + ".")
        if node is None:
            wanted = _keys(workers)
            return (f"Ray cannot place {name} ({fmt_resources(demand)}) beside the other "
                    f"workers: {len(workers)} workers need "
                    f"{fmt_resources(_total(workers.values()))}, and the cluster's "
                    f"{len(nodes)} node(s) have "
                    + "; ".join(fmt_resources({k: v for k, v in n.items() if k in wanted})
                                for n in nodes)
                    + ". Lower --num-cpus-per-worker / --num-gpus-per-worker, ask for fewer "
                    "workers, or add nodes.")
        for key, value in demand.items():
            node[key] = node.get(key, 0.0) - value
    return None


def until_placeable(workers: dict[str, dict[str, float]],
                    nodes: Callable[[], list[dict[str, float]]], timeout_s: float,
                    every_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> str | None:
    """`unplaceable` over `nodes()`, read again every `every_s` until the workers fit or
    `timeout_s` passed: a cluster joined at start (`ray up`, KubeRay) may have its head
    up before the nodes its workers need, which are starting or being added by Ray's
    autoscaler. Ray tells a driver nothing when a node joins. None, or the last reason."""
    deadline = clock() + timeout_s
    while (problem := unplaceable(workers, nodes())) is not None and clock() < deadline:
        sleep(every_s)
    return problem


def _total(demands) -> dict[str, float]:
    total: dict[str, float] = {}
    for demand in demands:
        for key, value in demand.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _keys(workers: dict[str, dict[str, float]]) -> set[str]:
    return {key for demand in workers.values() for key in demand}


def fmt_resources(resources: dict[str, float]) -> str:
    """{"CPU": 1, "GPU": 0.5} -> "1 CPU, 0.5 GPU"."""
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"
