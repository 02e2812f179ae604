"""How a pdserve command reaches Ray: a cluster of its own for this machine alone, or
an existing cluster it joins, sending Ray's token when the cluster wants one."""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

from pdserve import env

LOOPBACK = "127.0.0.1"
# Ray's switch for a single-machine cluster (its default on macOS and Windows): the node
# address is loopback, so every server Ray starts binds 127.0.0.1, and so do the KV
# rendezvous and data pairs, which bind the node address Ray reports. Ray reads it once,
# at import, in this process and in each process it starts.
_MULTI_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_local(**init_kwargs) -> None:
    """ray.init of a new cluster on this machine, every port it opens on loopback."""
    import ray

    _single_machine()
    ray.init(_node_ip_address=LOOPBACK, **init_kwargs)


def join(address: str, command: str, **init_kwargs) -> None:
    """ray.init of the cluster at `address` ("auto": the one this machine runs), with
    Ray's token exactly when the cluster wants one. Ray sends it only in token mode,
    which it enters by itself only for "auto" and then whenever a token exists, though
    a cluster without authentication then fails its actors' calls back to this process.
    So the cluster is asked first; one that wants a token this process cannot find is
    refused at once, naming what is missing. RAY_AUTH_MODE, when set, decides alone."""
    import ray

    if _single_machine_cluster(address):
        _single_machine()  # a node of it: this process must not resolve 127.0.0.1 away
    if env.ray_auth_mode() is None:
        wants = _wants_token(address)
        if wants and not _token_mode_if_token_found():
            raise SystemExit(f"pdserve {command}: {_auth_advice(address)}")
        if wants is False:
            os.environ["RAY_AUTH_MODE"] = "disabled"  # "auto" would turn a token found on
    try:
        ray.init(address=address, **init_kwargs)
    except Exception as err:  # noqa: BLE001 - Ray wraps the refusal in several types
        if not _refused_for_auth(err):
            raise
        raise SystemExit(f"pdserve {command}: {_auth_advice(address)}") from None


def _wants_token(address: str, timeout_s: float = 5.0) -> bool | None:
    """Whether the cluster's GCS refuses a call without a token (its cluster-id call,
    the first every Ray process makes); None when it cannot be asked."""
    import grpc

    try:
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - an address Ray cannot read: ray.init says why
        return None
    if target is None:
        return None
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            return None
    return False


def _single_machine() -> None:
    os.environ[_MULTI_NODE_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # when ray was imported before it was set


def _single_machine_cluster(address: str) -> bool:
    """A loopback address whose port answers on loopback alone: a cluster start_local
    made. (Ray resolves a loopback address to the node's, which a cluster of several
    machines also listens on.)"""
    host, _, port = address.rpartition(":")
    try:
        if not ipaddress.ip_address(host.strip("[]")).is_loopback:
            return False
    except ValueError:
        if host != "localhost":
            return False
    from ray._private.services import get_node_ip_address

    try:
        socket.create_connection((get_node_ip_address(), int(port)), timeout=2).close()
    except (OSError, ValueError):
        return True
    return False


def _token_mode_if_token_found() -> bool:
    """Token mode for this process, with the token Ray finds; False without one."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray before token authentication (2.52) cannot send one
        return False
    # Ray's own step for address "auto"; its warning speaks of starting a cluster.
    log = logging.getLogger(setup.__name__)
    level, log.level = log.level, logging.ERROR
    try:
        return setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)


def _refused_for_auth(err: BaseException | None) -> bool:
    """Ray raises AuthenticationError in token mode with no token, and a ConnectionError
    whose cause's text carries the GCS's InvalidAuthToken when the token is missing or
    wrong."""
    while err is not None:
        if type(err).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _auth_advice(address: str) -> str:
    mode = env.ray_auth_mode()
    source = env.ray_auth_token_source()
    if mode is not None and mode.lower() != "token":
        return (f"the Ray cluster at {address} requires token authentication and "
                f"RAY_AUTH_MODE is {mode!r}: unset it or set it to 'token'")
    if source is not None:
        return (f"the Ray cluster at {address} refused the token in {source}: give the "
                "cluster's (`ray get-auth-token` on its head node prints it)")
    return (f"the Ray cluster at {address} requires token authentication and no token "
            "was found: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a file holding it, "
            "or put it in ~/.ray/auth_token (`ray get-auth-token` on the cluster's head "
            "node prints it)")
