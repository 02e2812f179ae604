"""The receiver's races, provoked deterministically with hooks at its boundaries (the
receiver runs in this process, the sender in a worker process): every BEGIN gets
exactly one status, promptly, and the pair keeps working afterwards."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.kv_transfer import KVReceiver, TransferConfig
from tests.kv_transfer.harness import CacheSpec, RemoteError, Worker, sender_cache

SPEC = CacheSpec()
CONFIG = TransferConfig(timeout_s=20, connect_timeout_s=20)


@pytest.fixture()
def pair():
    released: list[str] = []
    caches = [torch.zeros(SPEC.layer_shape()) for _ in range(SPEC.num_layers)]
    receiver = KVReceiver(caches, CONFIG, on_release=released.append)
    sender = Worker("sender", "s", SPEC, seed=9, config=CONFIG)
    yield receiver, sender, caches, released
    sender.stop()
    receiver.close()


def _transfer_works(receiver, sender, caches, request_id, src, dst) -> None:
    receiver.expect(request_id, dst)
    sender.call("transfer", [(request_id, receiver.address, src, dst)])
    receiver.wait(request_id)
    want = sender_cache(SPEC, 9)
    for layer in range(SPEC.num_layers):
        assert torch.equal(caches[layer][:, dst], want[layer][:, src])


def test_an_abort_racing_begin_still_answers_the_sender_at_once(pair):
    # Defect 5 of #12: an abort landing between BEGIN's check and its claim left the
    # BEGIN without a status, so the sender waited out its whole timeout.
    receiver, sender, caches, released = pair
    real_check = receiver._check

    def check_then_abort(hs, incoming):
        problem = real_check(hs, incoming)
        if hs.request_id == "race":
            receiver.abort("race")  # the router's abort arrives right now
        return problem
    receiver._check = check_then_abort
    receiver.expect("race", [1, 2])
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as err:
        sender.call("transfer", [("race", receiver.address, [3, 4], [1, 2])])
    assert time.monotonic() - t0 < CONFIG.timeout_s / 4
    assert err.value.kind in ("TransferRefused", "TransferAborted")
    assert released == ["race"] and receiver.num_pending == 0
    _transfer_works(receiver, sender, caches, "after", [5, 6], [7, 8])


def test_an_expiry_racing_the_completion_leaves_one_outcome(pair):
    # The lease running out just as the transfer completes (its last layer landed
    # and its STEP_SENT read, whichever came second): either the transfer lands (OK,
    # blocks kept) or it expires (TIMED_OUT, blocks released), never both, and the
    # sender hears the same outcome the receiver settled on.
    receiver, sender, caches, released = pair
    real_complete = receiver._complete_locked
    outcome = {}

    def complete_racing_expiry(incoming):
        if incoming.request_id == "edge" and incoming.whole and (
                incoming.layers_landed == SPEC.num_layers):
            incoming.expires = time.monotonic() - 1  # the lease ran out meanwhile
            racer = threading.Thread(target=receiver._expire, args=(incoming,))
            racer.start()
            racer.join(0.5)  # it waits for the transfer's lock, which the caller holds
            outcome["racer_blocked"], outcome["racer"] = racer.is_alive(), racer
        return real_complete(incoming)
    receiver._complete_locked = complete_racing_expiry
    receiver.expect("edge", [10, 11])
    sender.call("transfer", [("edge", receiver.address, [1, 2], [10, 11])])
    receiver.wait("edge")
    outcome["racer"].join(10)
    assert outcome["racer_blocked"]
    assert released == [] and receiver.lease_expiries["transfer"] == 0
    _transfer_works(receiver, sender, caches, "after", [5, 6], [12, 13])


def test_the_transfer_deadline_counts_from_begin_not_from_the_reservation():
    # Defect 6 of #12: the deadline ran from expect(), so a prefill queue longer than
    # the transfer timeout failed a request whose KV then moved in milliseconds. The
    # receiver's clock is a fake here: the queue's wait is one step of it.
    now = [1000.0]
    config = TransferConfig(timeout_s=1.0, begin_lease_s=30, connect_timeout_s=20)
    caches = [torch.zeros(SPEC.layer_shape()) for _ in range(SPEC.num_layers)]
    receiver = KVReceiver(caches, config, clock=lambda: now[0])
    sender = Worker("sender", "s", SPEC, seed=9, config=config)
    try:
        receiver.expect("queued", [4, 5])
        now[0] += 2 * config.timeout_s  # waiting in the prefill queue
        sender.call("transfer", [("queued", receiver.address, [1, 2], [4, 5])])
        receiver.wait("queued")
        want = sender_cache(SPEC, 9)
        for layer in range(SPEC.num_layers):
            assert torch.equal(caches[layer][:, [4, 5]], want[layer][:, [1, 2]])
        assert receiver.lease_expiries == {"begin": 0, "transfer": 0, "start": 0}
    finally:
        sender.stop()
        receiver.close()
