"""Whether a cluster's nodes can hold the workers asked for, checked before any actor
is created: Ray would otherwise leave an actor it cannot place pending forever, and
`pdserve serve` would wait silently. Pure (node capacities in, a reason out)."""
from __future__ import annotations


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
            return (f"Ray cannot place {name} ({_fmt(demand)}): no node has that much; the "
                    f"cluster's {len(nodes)} node(s) have "
                    + "; ".join(_fmt({k: v for k, v in n.items() if k in demand})
                                for n in nodes) + ".")
        if node is None:
            return (f"Ray cannot place {name} ({_fmt(demand)}) beside the other workers: "
                    f"{len(workers)} workers need {_fmt(_total(workers.values()))}, and the "
                    f"cluster's {len(nodes)} node(s) have "
                    + "; ".join(_fmt({k: v for k, v in n.items() if k in _keys(workers)})
                                for n in nodes)
                    + ". Lower --num-cpus-per-worker / --num-gpus-per-worker, ask for fewer "
                    "workers, or add nodes.")
        for key, value in demand.items():
            node[key] = node.get(key, 0.0) - value
    return None


def _total(demands) -> dict[str, float]:
    total: dict[str, float] = {}
    for demand in demands:
        for key, value in demand.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _keys(workers: dict[str, dict[str, float]]) -> set[str]:
    return {key for demand in workers.values() for key in demand}


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"
