"""The KV rendezvous is not open to strangers: the receiver's store listens on its own
address only, and a party without the cluster's secret can neither read its keys nor
pair with it, while the cluster's own sender transfers as before."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kv_transfer import KVReceiver, TransferConfig, rendezvous
from pdserve.kv_transfer import protocol as P
from tests.kv_transfer.harness import CacheSpec, RemoteError, Worker, sender_cache

SPEC = CacheSpec()
CONFIG = TransferConfig(timeout_s=20, connect_timeout_s=5, secret="cluster-secret-1f3a")
HOST = "127.0.0.2"  # a loopback address other than the usual one


@pytest.fixture()
def receiver():
    caches = [torch.zeros(SPEC.layer_shape()) for _ in range(SPEC.num_layers)]
    receiver = KVReceiver(caches, CONFIG, host=HOST)
    yield receiver, caches
    receiver.close()


def port_of(receiver: KVReceiver) -> int:
    return int(receiver.address.rsplit(":", 1)[1])


def test_the_store_listens_on_its_own_address_only(receiver):
    receiver, _ = receiver
    assert receiver.address == f"{HOST}:{port_of(receiver)}"
    with pytest.raises(Exception):  # the same port on another address: nobody there
        rendezvous.connect("127.0.0.1", port_of(receiver), timeout_s=2)
    rendezvous.connect(HOST, port_of(receiver), timeout_s=5)


def test_without_the_secret_nothing_can_be_read_or_paired(receiver):
    receiver, caches = receiver
    stranger = rendezvous.connect(HOST, port_of(receiver), timeout_s=5)
    assert not stranger.check([P.LAYOUT_KEY])  # the layout is there, under the secret
    assert rendezvous.scoped(stranger, CONFIG.secret).check([P.LAYOUT_KEY])
    guesser = Worker("sender", "guesser", SPEC, seed=3, config=replace(CONFIG, secret="guess"))
    try:
        with pytest.raises(RemoteError) as err:
            guesser.call("transfer", [("r0", receiver.address, [1], [2])])
        assert err.value.kind == "PeerLostError" and "not of this cluster" in str(err.value)
    finally:
        guesser.stop()
    member = Worker("sender", "member", SPEC, seed=9, config=CONFIG)
    try:
        receiver.expect("r1", [4, 5])
        member.call("transfer", [("r1", receiver.address, [1, 2], [4, 5])])
        receiver.wait("r1")
    finally:
        member.stop()
    want = sender_cache(SPEC, 9)
    for layer in range(SPEC.num_layers):
        assert torch.equal(caches[layer][:, [4, 5]], want[layer][:, [1, 2]])
