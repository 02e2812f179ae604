"""The `pdserve` command line: serve, router, demo, bench, sim, profile, admin,
make-tiny-model.

Engine and pool flags are derived from their config dataclasses (`cli_flags`); each
subcommand owns its flags. Heavy modules (torch, Ray) are imported by the command
that runs, so `pdserve --help` stays fast.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from pdserve import cli_flags, env
from pdserve.admin_cli import add_admin_parser
from pdserve.bench.cli import add_bench_parser
from pdserve.router.config import (
    AutoscaleSpec,
    PoolSpec,
    RouterConfig,
    RoutingSpec,
    SharedStateSpec,
)
from pdserve.sim.cli import add_sim_parser
from pdserve.sim.measure import add_profile_parser


def main(argv: list[str] | None = None) -> int:
    # Every command that uses Ray calls ray.init itself; a stray call on a handle after
    # shutdown must fail, not quietly start a second local cluster.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_router_parser(sub)
    _add_demo_parser(sub)
    add_bench_parser(sub)
    add_sim_parser(sub)
    add_profile_parser(sub)
    add_admin_parser(sub)
    tiny = sub.add_parser("make-tiny-model", help="write a random-weight HF model + tokenizer",
                          description="Write the tiny random-weight Llama and its locally "
                          "trained tokenizer as an HF directory.")
    tiny.add_argument("dir", help="the directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    tiny.set_defaults(func=_make_tiny)
    return parser


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The model, the pools and the engine: what `serve` and `bench compare` launch."""
    p.add_argument("--model", default="tiny", help="a local HF directory, or `tiny` "
                   "(default: %(default)s)")
    pools = p.add_argument_group("pools")
    cli_flags.add_flags(pools, PoolSpec)
    pools.add_argument("--transfer-timeout", type=float, default=30.0,
                       help="seconds a KV transfer may take (default: %(default)s)")
    add_router_flags(p)
    cli_flags.add_engine_flags(p)


def add_router_flags(p: argparse.ArgumentParser) -> None:
    """Routing, the planner, replicas over Redis, the router's timeouts and limits:
    what `serve` and `router` share."""
    cli_flags.add_flags(p.add_argument_group("routing"), RoutingSpec)
    cli_flags.add_flags(p.add_argument_group("autoscaling (the SLO planner)"), AutoscaleSpec)
    cli_flags.add_flags(p.add_argument_group("router replicas (state shared in Redis)"),
                        SharedStateSpec)
    p.set_defaults(redis_url=env.redis_url())
    cli_flags.add_flags(p.add_argument_group("router timeouts and limits"), RouterConfig,
                        only=RouterConfig.flags())


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The router's settings from the flags; a bad value exits saying which flag."""
    try:
        return RouterConfig(routing=RoutingSpec(**cli_flags.values(args, RoutingSpec)),
                            autoscale=AutoscaleSpec(**cli_flags.values(args, AutoscaleSpec)),
                            shared=SharedStateSpec(**cli_flags.values(args, SharedStateSpec)),
                            **cli_flags.values(args, RouterConfig, only=RouterConfig.flags()))
    except ValueError as err:
        raise SystemExit(f"pdserve {args.command}: {err}") from None


def cluster_specs(args: argparse.Namespace) -> tuple[PoolSpec, RouterConfig]:
    """The pools' and the router's settings from the flags; a bad combination exits
    with what is wrong, before anything starts."""
    try:
        pools = PoolSpec(**cli_flags.values(args, PoolSpec))
    except ValueError as err:
        raise SystemExit(f"pdserve {args.command}: {err}") from None
    return pools, router_config(args)


def launch_cluster(args: argparse.Namespace, **engine_overrides):
    """Blocking: the pools are up when it returns (ray.init first)."""
    from pdserve.kv_transfer import TransferConfig
    from pdserve.router.launch import launch

    config = cli_flags.engine_config(args, args.model, **engine_overrides)
    pools, routing = cluster_specs(args)
    # A cluster joined (--ray-address) may still be starting the nodes the workers need;
    # one started here has all the nodes it will ever have.
    joined = getattr(args, "ray_address", None) is not None
    return launch(config, pools, TransferConfig(timeout_s=args.transfer_timeout), routing,
                  served_model_name=getattr(args, "served_model_name", None) or args.model,
                  wait_for_nodes_s=routing.placement_timeout_s if joined else 0.0)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="start the cluster and serve gRPC + HTTP",
                           description="Start the worker pools on Ray and serve the "
                           "gRPC and OpenAI-compatible HTTP APIs until SIGINT / SIGTERM.")
    add_cluster_flags(serve)
    front = serve.add_argument_group("front end")
    front.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model)")
    front.add_argument("--ray-address", default=None,
                       help="join this Ray cluster, e.g. auto (default: start a local one)")
    _add_front_flags(front)
    serve.set_defaults(func=_serve)


def _add_router_parser(sub) -> None:
    router = sub.add_parser(
        "router", help="another router replica over a pool `serve --redis-url` registered",
        description="Serve the gRPC and OpenAI-compatible HTTP APIs over the pool "
        "registered in Redis (--redis-url, --redis-prefix) by `pdserve serve`: the "
        "replicas share its workers, refuse each other's request ids, forward aborts to "
        "each other and apply each other's membership changes. Until SIGINT / SIGTERM.")
    add_router_flags(router)
    front = router.add_argument_group("front end")
    front.add_argument("--ray-address", default=None,
                       help="the pool's Ray cluster (default: the address it registered)")
    front.add_argument("--model-dir", default=None,
                       help="where the model is on this machine, for its tokenizer "
                       "(default: the directory the pool registered)")
    _add_front_flags(front)
    router.set_defaults(func=_router)


def _add_front_flags(front) -> None:
    front.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    front.add_argument("--grpc-port", type=int, default=50051,
                       help="0 picks a free port (default: %(default)s)")
    front.add_argument("--http-port", type=int, default=8000,
                       help="0 picks a free port (default: %(default)s)")
    front.add_argument("--api-key", default=env.api_key(),
                       help="clients must send Authorization: Bearer <key> (HTTP /v1 and "
                       "/metrics, every gRPC API call); default: $PDSERVE_API_KEY, else none")
    front.add_argument("--admin-api-key", default=env.admin_api_key(),
                       help="serve the admin API (/admin: add, drain, re-role, remove "
                       "workers; `pdserve admin`) behind this key; default: "
                       "$PDSERVE_ADMIN_API_KEY, else no admin API")
    front.add_argument("--ssl-certfile", default=None,
                       help="serve HTTPS and gRPC over TLS with this PEM certificate")
    front.add_argument("--ssl-keyfile", default=None, help="its PEM private key")
    front.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM "
                       "(default: %(default)s)")


def _add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="1 prefill + 1 decode worker on the tiny model, "
                          "a few requests through the SDK and the HTTP API")
    demo.add_argument("--model", default="tiny", help="a local HF directory, or `tiny` "
                      "(default: %(default)s)")
    demo.add_argument("--offline", action="store_true",
                      help="run the offline engine instead of the cluster")
    demo.add_argument("--num-prompts", type=int, default=8,
                      help="concurrent requests (default: %(default)s)")
    demo.add_argument("--max-tokens", type=int, default=32,
                      help="tokens per request (default: %(default)s)")
    demo.set_defaults(func=_demo)


def _serve(args) -> int:
    import ray

    from pdserve import ray_session

    cluster_specs(args)  # checked before Ray starts
    _front_security(args)
    if args.ray_address is None:
        ray_session.start_local(include_dashboard=False, log_to_driver=True)
    else:
        ray_session.join(args.ray_address, "serve", include_dashboard=False,
                         log_to_driver=False)
    from pdserve.router.pool.placement import PlacementError
    from pdserve.router.replicas.pool_registry import RegistryError
    try:
        router = launch_cluster(args)
    except (PlacementError, RegistryError) as err:
        ray.shutdown()
        raise SystemExit(f"pdserve serve: {err}") from None
    return _run_front(args, router, f"{args.model!r} ({args.mode})")


def _router(args) -> int:
    from redis.exceptions import RedisError

    from pdserve import ray_session
    from pdserve.router.launch import join
    from pdserve.router.replicas.redis_registry import read_registered

    config = router_config(args)
    spec = config.shared
    if not spec.redis_url:
        raise SystemExit("pdserve router: --redis-url (or $PDSERVE_REDIS_URL) names the "
                         "Redis the pool is registered in")
    _front_security(args)
    try:
        record, entries = read_registered(spec)
    except RedisError as err:
        raise SystemExit(f"pdserve router: Redis cannot be reached: {err}") from None
    if record is None:
        raise SystemExit(f"pdserve router: no pool is registered under --redis-prefix "
                         f"{spec.redis_prefix!r}; start one with `pdserve serve --redis-url`")
    ray_session.join(args.ray_address or record.ray_address, "router",
                     include_dashboard=False, log_to_driver=False)
    router = join(record, entries, config, args.model_dir)
    return _run_front(args, router, f"{record.model.name!r} as a replica "
                      f"({len(router.workers)} workers)")


def _front_security(args):
    """The front end's keys and TLS from the flags (a bad pair exits at once)."""
    from pdserve.router.config import TLSConfig
    from pdserve.router.front.auth import ApiKeys

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise SystemExit(f"pdserve {args.command}: give --ssl-certfile and --ssl-keyfile "
                         "together")
    return (ApiKeys((args.api_key,) if args.api_key else ()),
            TLSConfig(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None,
            ApiKeys((args.admin_api_key,) if args.admin_api_key else ()))


def _run_front(args, router, what: str) -> int:
    """Serves the router's front ends until SIGINT / SIGTERM, then drains."""
    import ray

    from pdserve.router.front.server import RouterServer

    keys, tls, admin_keys = _front_security(args)
    srv = RouterServer(router, args.host, args.grpc_port, args.http_port, keys, tls,
                       admin_keys)
    print(f"pdserve serving {what}: gRPC {srv.grpc_target}  HTTP {srv.http_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(f"draining (up to {args.drain_timeout:g}s) ...", flush=True)
    srv.stop(args.drain_timeout)
    ray.shutdown()
    print("stopped", flush=True)
    return 0


def _demo(args) -> int:
    from pdserve import demo

    return demo.offline(args) if args.offline else demo.cluster(args)


def _make_tiny(args) -> int:
    from dataclasses import replace

    from pdserve.engine.tiny_model import TINY, make_tiny_model

    path = make_tiny_model(args.dir, replace(TINY, seed=args.seed))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
