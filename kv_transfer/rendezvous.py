"""Where a receiver's pairs meet: its TCPStore, bound to one address, and a key space
named by the cluster's secret.

torch's TCPStore has no authentication, its clients may list every key, and by
default its server listens on every interface. Here it listens only on the address
given (the node's, as Ray reports it), through a socket bound before the store takes
it. Keys live under the cluster's secret, which keeps clusters apart but hides
nothing from a client that lists them; what keeps strangers out of the data path is
that a join must carry an HMAC of its pair name under the secret, and each pair name
opens once (receiver.py). Traffic is not encrypted, and an attacker on the cluster
network can still disturb a pair's rendezvous: keep the ports private (SECURITY.md)."""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def serve(host: str, timeout_s: float) -> dist.TCPStore:
    """The receiver's store, listening on `host` only, on a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, master_listen_fd=sock.fileno(),
                              timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def scoped(store: dist.Store, secret: str) -> dist.Store:
    """The key space every party of one cluster shares (the whole store without one)."""
    return dist.PrefixStore(f"{secret}/", store) if secret else store
