"""The KV rendezvous is not open to strangers: the receiver's store listens on its own
address only, and a party without the cluster's secret cannot pair with it (a join
must carry an HMAC under the secret; a join replayed from the store is refused),
while the cluster's own sender transfers as before."""
from __future__ import annotations

import threading
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


def test_without_the_secret_no_pair_opens(receiver):
    receiver, caches = receiver
    guesser = Worker("sender", "guesser", SPEC, seed=3, config=replace(CONFIG, secret="guess"))
    try:
        with pytest.raises(RemoteError) as err:
            guesser.call("transfer", [("r0", receiver.address, [1], [2])])
        assert err.value.kind == "PeerLostError" and "not of this cluster" in str(err.value)
    finally:
        guesser.stop()
    transfer_as_member(receiver)
    want = sender_cache(SPEC, 9)
    for layer in range(SPEC.num_layers):
        assert torch.equal(caches[layer][:, [4, 5]], want[layer][:, [1, 2]])


def test_a_forged_or_replayed_join_opens_nothing(receiver):
    receiver, _ = receiver
    stranger = rendezvous.connect(HOST, port_of(receiver), timeout_s=5)
    # TCPStore hides nothing from a client that asks: the secret's key space shows.
    assert any(CONFIG.secret in key for key in stranger.list_keys())
    scoped = rendezvous.scoped(stranger, CONFIG.secret)
    transfer_as_member(receiver)
    verdicts, judged = [], threading.Event()
    admits = receiver._admits

    def recorded(record):  # the receiver's verdict on each join, as it gives it
        verdicts.append((record.pair, admits(record)))
        if len(verdicts) == 2:
            judged.set()
        return verdicts[-1][1]
    receiver._admits = recorded
    legit = scoped.get(P.join_key(1))
    forged = P.JoinRecord("evil", "evil-pair", "gloo", proof="0" * 64).encode()
    for record in (forged, legit):  # a made-up proof, and the member's own join again
        scoped.set(P.join_key(scoped.add(P.JOIN_COUNTER, 1)), record)
    assert judged.wait(10), verdicts
    assert verdicts == [("evil-pair", False), (P.JoinRecord.decode(legit).pair, False)]
    assert "evil-pair" not in receiver._pairs


def transfer_as_member(receiver: KVReceiver) -> None:
    """One transfer from a sender of the cluster (seed 9's blocks 1, 2 -> 4, 5)."""
    member = Worker("sender", "member", SPEC, seed=9, config=CONFIG)
    try:
        receiver.expect("r1", [4, 5])
        member.call("transfer", [("r1", receiver.address, [1, 2], [4, 5])])
        receiver.wait("r1")
    finally:
        member.stop()
