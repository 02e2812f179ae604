"""Whether a cluster's node types can hold the workers a `pdserve serve` command may
ask for: each pool's ceiling (the planner's, or the fixed size without --autoscale)
in slots of its custom resource, every rank of a tensor-parallel worker on the one
node, and the budget in GPUs."""
from __future__ import annotations

from pdserve.cli import build_parser, cluster_specs


def serve_settings(argv: list[str]):
    """The pools and router settings a `pdserve serve` command line makes (pdserve's own
    parser and checks: a bad flag or combination raises SystemExit)."""
    args = build_parser().parse_args(argv)
    return (*cluster_specs(args), args.tensor_parallel_size)


def shortfalls(argv: list[str], node_types: dict[str, dict]) -> list[str]:
    """What the node types ({name: {"resources": {...}, "max_workers": n}}) cannot hold
    of what `argv` may start; [] when everything fits. A node type that leaves out CPU
    or GPU (Ray detects them at start) is judged by its custom resources alone."""
    pools, router, tensor_parallel_size = serve_settings(argv)
    scale = router.autoscale
    ceilings = ({"prefill": scale.max_prefill_workers, "decode": scale.max_decode_workers}
                if scale.autoscale else
                {"prefill": pools.roles.count("prefill"),
                 "decode": pools.roles.count("decode") + pools.roles.count("both")})
    found = []
    sizes = {role: pools.tensor_parallel_size(role, tensor_parallel_size)
             for role in ceilings}
    for role, ceiling in ceilings.items():
        demand = {**pools.resources(role), "GPU": pools.num_gpus_per_worker * sizes[role],
                  "CPU": pools.num_cpus_per_worker * sizes[role]}
        slots = 0
        for node in node_types.values():
            have = node["resources"]
            # CPU and GPU a node type leaves out are detected when the node starts
            counted = {name: amount for name, amount in demand.items()
                       if amount and (name in have or name not in ("CPU", "GPU"))}
            if all(have.get(name, 0) >= amount for name, amount in counted.items()):
                per_node = min(int(have[name] // amount) for name, amount in counted.items())
                slots += per_node * node.get("max_workers", 0)
        if slots < ceiling:
            found.append(f"{role}: up to {ceiling} workers, room for {slots} "
                         f"(each needs {demand})")
    declared = any("GPU" in n["resources"] for n in node_types.values())
    if scale.autoscale and pools.num_gpus_per_worker and declared:
        gpus = sum(n["resources"].get("GPU", 0) * n.get("max_workers", 0)
                   for n in node_types.values())
        budget = scale.max_devices or scale.max_workers * max(sizes.values())
        if gpus < budget * pools.num_gpus_per_worker:
            flag = f"--max-devices {scale.max_devices}" if scale.max_devices \
                else f"--max-workers {scale.max_workers}"
            found.append(f"{flag}: {gpus:g} GPUs in all")
    return found
