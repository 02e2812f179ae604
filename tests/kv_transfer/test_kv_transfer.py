"""kv_transfer between real processes over real torch.distributed (gloo) pairs.

The data stream is one FIFO with no tags (gloo on a single tag), which is NCCL's
matching rule: every test here runs the ordered protocol NCCL depends on. The CUDA
tests at the end need GPUs and say which."""
from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from pdserve.kv_transfer import KVLayout, TransferConfig
from pdserve.kv_transfer import protocol as P
from tests.kv_transfer.harness import CacheSpec, RemoteError, Worker, sender_cache

SPEC = CacheSpec()


def expected_blocks(spec: CacheSpec, seed: int, src_blocks: list[int]) -> list[torch.Tensor]:
    return [c[:, src_blocks] for c in sender_cache(spec, seed)]


def assert_landed(receiver: Worker, sender: Worker, src: list[int], dst: list[int]) -> None:
    got = receiver.call("blocks", dst)
    want = expected_blocks(sender.spec, sender.seed, src)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"layer {layer} differs"


def expect_all(receiver: Worker, jobs) -> None:
    """jobs: (request id, source blocks, destination blocks)."""
    for rid, _, dst in jobs:
        receiver.call("expect", rid, dst)


def assert_all_landed(receiver: Worker, sender: Worker, jobs) -> None:
    for rid, src, dst in jobs:
        receiver.call("wait", rid)
        assert_landed(receiver, sender, src, dst)


@pytest.fixture(scope="module")
def pair():
    receiver, sender = Worker("receiver", "r0"), Worker("sender", "s0", seed=7)
    yield receiver, sender
    receiver.stop()
    sender.stop()


@pytest.mark.parametrize("spec", [
    CacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32"),
    CacheSpec(num_layers=3, block_size=8, num_kv_heads=1, head_dim=128, dtype="bfloat16"),
    CacheSpec(num_layers=4, block_size=32, num_kv_heads=4, head_dim=32, dtype="bfloat16"),
])
def test_scattered_blocks_arrive_bitwise_equal(spec):
    receiver, sender = Worker("receiver", "r", spec), Worker("sender", "s", spec, seed=3)
    try:
        src, dst = [5, 1, 17, 30, 2], [9, 20, 3, 11, 0]
        receiver.call("expect", "req", dst)
        assert sender.call("transfer", [("req", receiver.address, src, dst)]) == [
            len(src) * KVLayout(spec.num_layers, spec.block_size, spec.num_kv_heads,
                                spec.head_dim, spec.dtype).block_bytes_per_layer * spec.num_layers]
        receiver.call("wait", "req")
        assert_landed(receiver, sender, src, dst)
        untouched = [b for b in range(spec.num_blocks) if b not in dst]
        assert all(not t.any() for t in receiver.call("blocks", untouched))
    finally:
        receiver.stop()
        sender.stop()


def test_blocks_the_receiver_holds_are_not_sent(pair):
    receiver, sender = pair
    src, dst, cached = [3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15], 4
    receiver.call("expect", "prefix", dst[cached:], cached)
    before = receiver.call("bytes_received")
    block_bytes = KVLayout(SPEC.num_layers, SPEC.block_size, SPEC.num_kv_heads,
                           SPEC.head_dim, SPEC.dtype).block_bytes_per_layer
    sent = sender.call("transfer", [("prefix", receiver.address, src, dst, cached)])
    receiver.call("wait", "prefix")
    assert sent == [2 * block_bytes * SPEC.num_layers]
    payload = receiver.call("bytes_received") - before
    assert 2 * block_bytes * SPEC.num_layers <= payload < 3 * block_bytes * SPEC.num_layers
    assert_landed(receiver, sender, src[cached:], dst[cached:])
    assert all(not t.any() for t in receiver.call("blocks", dst[:cached]))


def test_layout_mismatch_is_refused_with_what_differs():
    receiver = Worker("receiver", "r", CacheSpec(head_dim=32, dtype="bfloat16"))
    sender = Worker("sender", "s", CacheSpec(head_dim=64, dtype="float32"))
    try:
        receiver.call("expect", "req", [1, 2])
        with pytest.raises(RemoteError) as err:
            sender.call("transfer", [("req", receiver.address, [1, 2], [1, 2])])
        assert err.value.kind == "LayoutMismatchError"
        assert "head_dim: 64 here vs 32 there" in str(err.value)
        assert "dtype: float32 here vs bfloat16 there" in str(err.value)
    finally:
        receiver.stop()
        sender.stop()


def test_unexpected_request_is_refused_and_the_pair_keeps_working(pair):
    receiver, sender = pair
    with pytest.raises(RemoteError) as err:
        sender.call("transfer", [("nobody-reserved", receiver.address, [1], [2])])
    assert err.value.kind == "TransferRefused" and "not expected" in str(err.value)
    receiver.call("expect", "after", [2, 3])
    sender.call("transfer", [("after", receiver.address, [8, 9], [2, 3])])
    receiver.call("wait", "after")
    assert_landed(receiver, sender, [8, 9], [2, 3])


def test_two_senders_two_receivers_interleaved_and_a_late_joiner():
    receivers = [Worker("receiver", f"r{i}") for i in range(2)]
    senders = [Worker("sender", f"s{i}", seed=10 + i) for i in range(2)]
    late = None
    try:
        # Each transfer has its own size: a payload landing in another's receive
        # (the stream out of order) would fail the size check or the bitwise compare.
        jobs = {}  # (sender, receiver) -> (request id, src, dst)
        for si, s in enumerate(senders):
            for ri, r in enumerate(receivers):
                rid = f"s{si}-r{ri}"
                n = 1 + si * 2 + ri
                src = [si * 8 + ri * 4 + k for k in range(n)]
                dst = [si * 12 + ri * 5 + k for k in range(n)]
                jobs[si, ri] = (rid, src, dst)
                r.call("expect", rid, dst)
        for si, s in enumerate(senders):  # both senders stream at once, slowly
            s.start("transfer", [(jobs[si, ri][0], receivers[ri].address, jobs[si, ri][1],
                                  jobs[si, ri][2]) for ri in range(2)], 0.3)
        late = Worker("sender", "late", seed=99)  # joins while the others stream
        receivers[0].call("expect", "late", [30, 31])
        late.call("transfer", [("late", receivers[0].address, [0, 1], [30, 31])])
        for s in senders:
            s.result()
        for (si, ri), (rid, src, dst) in jobs.items():
            receivers[ri].call("wait", rid)
            assert_landed(receivers[ri], senders[si], src, dst)
        receivers[0].call("wait", "late")
        assert_landed(receivers[0], late, [0, 1], [30, 31])
    finally:
        for w in receivers + senders + ([late] if late else []):
            w.stop()


@pytest.mark.parametrize("window", [1, 64 << 20])
def test_one_step_of_several_transfers_to_one_receiver_lands_each_bitwise(window):
    # Three transfers of different sizes in one step: layer-major slots, every
    # receive posted at the STEP (the default window), or one at a time (a window
    # smaller than any payload posts one receive per landing).
    config = TransferConfig(timeout_s=20, connect_timeout_s=20, receive_window_bytes=window)
    receiver = Worker("receiver", "r", config=config)
    sender = Worker("sender", "s", seed=8, config=config)
    try:
        jobs = [("t1", [3], [20]), ("t3", [9, 10, 11], [21, 25, 22]), ("t2", [6, 7], [30, 23])]
        expect_all(receiver, jobs)
        sender.call("transfer", [(rid, receiver.address, src, dst) for rid, src, dst in jobs])
        assert_all_landed(receiver, sender, jobs)
    finally:
        receiver.stop()
        sender.stop()


def test_last_copies_queued_together_go_as_one_step_and_land_each_bitwise():
    """Live migration: the moves off a draining worker pause together, and the last
    copies queued for one receiver while its lane was busy go as one step."""
    receiver, sender = Worker("receiver", "r"), Worker("sender", "s", seed=9)
    try:
        jobs = [("c1", [4], [12]), ("c2", [5, 6], [13, 27]), ("c3", [8], [2])]
        expect_all(receiver, jobs)
        sent, steps = sender.call("urgent_copies", receiver.address, jobs)
        per_block = KVLayout(SPEC.num_layers, SPEC.block_size, SPEC.num_kv_heads,
                             SPEC.head_dim, SPEC.dtype).block_bytes_per_layer * SPEC.num_layers
        assert sent == [len(src) * per_block for _, src, _ in jobs]
        assert steps == [3]
        assert_all_landed(receiver, sender, jobs)
    finally:
        receiver.stop()
        sender.stop()


def test_a_step_left_unfinished_ends_its_transfers_at_the_next_step():
    # A forward pass that failed after layer 0 leaves its step unfinished; the pair's
    # next STEP first ends it (ABORT, remaining slots padded), so the stream is in
    # step: the stranded transfer fails ABORTED, the next one lands.
    from pdserve.kv_transfer import TransferAborted
    with _in_process_sender(6) as (receiver, sender):
        receiver.call("expect", "stranded", [1, 2])
        stranded = sender.begin("stranded", receiver.address, [3, 4], [1, 2])
        assert not sender.announce([stranded])
        assert not sender.send_layers([stranded], 0)
        alone = sender.begin("alone", receiver.address, [5], [6])
        with pytest.raises(ValueError, match="announced together"):
            sender.send_layer(alone, 0)  # send_layer would end the stranded one
        sender.abort(alone)
        receiver.call("expect", "next", [5, 6])
        handle = sender.begin("next", receiver.address, [7, 8], [5, 6])
        assert not sender.announce([handle])  # ends the stranded transfer first
        for layer in range(SPEC.num_layers):
            assert not sender.send_layers([handle], layer)
        sender.finish(handle)
        receiver.call("wait", "next")
        got = receiver.call("blocks", [5, 6])
        assert all(torch.equal(g, w) for g, w in zip(got, expected_blocks(SPEC, 6, [7, 8])))
        with pytest.raises(RemoteError) as err:
            receiver.call("wait", "stranded")
        assert err.value.kind == TransferAborted.__name__
        sender.abort(stranded)  # what the prefill role does next: settles, no error
        assert stranded.closed


def test_sender_killed_mid_transfer_frees_the_receivers_blocks():
    receiver, sender = Worker("receiver", "r"), Worker("sender", "s")
    try:
        receiver.call("expect", "doomed", [4, 5, 6])
        sender.start("transfer", [("doomed", receiver.address, [1, 2, 3], [4, 5, 6])], 0.0, 1,
                     "hang")
        receiver.call("wait_landed", "doomed", 1, 30)  # the sender now hangs after layer 0
        sender.kill()
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            receiver.call("wait", "doomed")
        assert err.value.kind == "PeerLostError"
        assert time.monotonic() - t0 < 10  # within the transfer timeout
        assert receiver.call("released") == ["doomed"]
        assert receiver.call("pending") == 0
    finally:
        receiver.stop()
        sender.stop()


def test_receiver_killed_mid_transfer_gives_the_sender_a_typed_error():
    receiver, sender = Worker("receiver", "r"), Worker("sender", "s")
    try:
        receiver.call("expect", "orphan", [4, 5, 6])
        sender.start("transfer", [("orphan", receiver.address, [1, 2, 3], [4, 5, 6])], 1.0)
        receiver.call("wait_landed", "orphan", 1, 30)  # mid-transfer: more layers to come
        receiver.kill()
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            sender.result(timeout=30)
        assert err.value.kind in ("PeerLostError", "TransferTimeout")
        assert time.monotonic() - t0 < 12
    finally:
        receiver.stop()
        sender.stop()


def test_sender_abort_mid_transfer_releases_blocks_and_keeps_the_pair(pair):
    receiver, sender = pair
    receiver.call("expect", "quit", [20, 21])
    assert sender.call("transfer", [("quit", receiver.address, [1, 2], [20, 21])], 0.0, 1,
                       "abort") == "aborted"
    with pytest.raises(RemoteError) as err:
        receiver.call("wait", "quit")
    assert err.value.kind == "TransferAborted"
    assert "quit" in receiver.call("released")
    receiver.call("expect", "next", [20, 21])
    sender.call("transfer", [("next", receiver.address, [6, 7], [20, 21])])
    receiver.call("wait", "next")
    assert_landed(receiver, sender, [6, 7], [20, 21])


def test_receiver_abort_mid_transfer_reaches_the_sender(pair):
    receiver, sender = pair
    receiver.call("expect", "cancel", [24, 25])
    sender.start("transfer", [("cancel", receiver.address, [1, 2], [24, 25])], 0.5)
    receiver.call("wait_landed", "cancel", 1, 30)  # mid-transfer: more layers to come
    receiver.call("abort", "cancel")
    with pytest.raises(RemoteError) as err:
        sender.result()
    assert err.value.kind == "TransferAborted"
    assert "cancel" in receiver.call("released")
    receiver.call("expect", "then", [24, 25])  # the pair survived the abort
    sender.call("transfer", [("then", receiver.address, [3, 4], [24, 25])])
    receiver.call("wait", "then")
    assert_landed(receiver, sender, [3, 4], [24, 25])


def test_a_reservation_whose_transfer_never_begins_is_released_by_its_lease():
    config = TransferConfig(timeout_s=30, begin_lease_s=1.0)
    receiver = Worker("receiver", "r", config=config)
    try:
        receiver.call("expect", "never", [1, 2])
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            receiver.call("wait", "never", 10.0)
        assert err.value.kind == "TransferTimeout" and "no transfer began" in str(err.value)
        assert time.monotonic() - t0 < 5
        assert receiver.call("released") == ["never"]
        assert receiver.call("lease_expiries") == {"begin": 1, "transfer": 0, "start": 0}
    finally:
        receiver.stop()


def test_landed_kv_that_is_never_started_is_released_by_its_lease():
    config = TransferConfig(timeout_s=30, start_lease_s=1.0)
    receiver, sender = Worker("receiver", "r", config=config), Worker("sender", "s", seed=4,
                                                                      config=config)
    try:
        receiver.call("expect", "orphan", [6, 7])
        sender.call("transfer", [("orphan", receiver.address, [1, 2], [6, 7])])
        # Nobody calls wait / landed: the router that reserved it is gone.
        assert receiver.call("wait_released", "orphan", 10.0) == ["orphan"]
        assert receiver.call("pending") == 0
        assert receiver.call("lease_expiries") == {"begin": 0, "transfer": 0, "start": 1}
    finally:
        receiver.stop()
        sender.stop()


def test_a_handshake_longer_than_one_control_message_and_the_next_transfer():
    # ~3,000 block ids do not fit the fixed BEGIN message: the tail goes as an
    # extension, and the control stream stays in step for the transfer after it.
    spec = CacheSpec(num_layers=2, num_blocks=4096, block_size=1, num_kv_heads=1, head_dim=8)
    receiver, sender = Worker("receiver", "r", spec), Worker("sender", "s", spec, seed=5)
    try:
        order = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(0))
        src, dst = order[:3000].tolist(), order[1000:4000].tolist()
        assert len(json.dumps(dst)) > P.CONTROL_BYTES
        receiver.call("expect", "long", dst)
        sender.call("transfer", [("long", receiver.address, src, dst)])
        receiver.call("wait", "long")
        assert_landed(receiver, sender, src, dst)
        receiver.call("expect", "short", [7, 3])
        sender.call("transfer", [("short", receiver.address, [1, 2], [7, 3])])
        receiver.call("wait", "short")
        assert_landed(receiver, sender, [1, 2], [7, 3])
    finally:
        receiver.stop()
        sender.stop()


def test_a_pair_survives_idle_time_longer_than_every_timeout():
    # Regression: gloo's context kept the connect timeout for every op, so the
    # receiver's always-posted control receive expired on an idle pair and the next
    # transfer failed with "Connection closed by peer". The idle period is the
    # scenario itself (no synchronization waits on it): 3x every configured timeout.
    config = TransferConfig(timeout_s=1, connect_timeout_s=1)
    receiver = Worker("receiver", "r", config=config)
    sender = Worker("sender", "s", seed=5, config=config)
    try:
        for request, dst in (("before-idle", [1, 2]), ("after-idle", [3, 4])):
            receiver.call("expect", request, dst)
            sender.call("transfer", [(request, receiver.address, [6, 7], dst)])
            receiver.call("wait", request)
            assert_landed(receiver, sender, [6, 7], dst)
            time.sleep(3 * max(config.timeout_s, config.connect_timeout_s))
    finally:
        receiver.stop()
        sender.stop()


@contextlib.contextmanager
def _in_process_sender(seed: int):
    """A receiver in its worker process and a KVSender in this one (the test reaches
    into its pair)."""
    from pdserve.kv_transfer import KVSender
    config = TransferConfig(timeout_s=10, connect_timeout_s=20)
    receiver = Worker("receiver", "r", config=config)
    sender = KVSender("s", sender_cache(SPEC, seed), config)
    try:
        yield receiver, sender
    finally:
        sender.close()
        receiver.stop()


def _in_process_transfer_lands(receiver: Worker, sender, seed: int) -> None:
    """One more transfer from an in-process KVSender lands bitwise equal."""
    receiver.call("expect", "next", [5, 6])
    handle = sender.begin("next", receiver.address, [7, 8], [5, 6])
    for layer in range(SPEC.num_layers):
        sender.send_layer(handle, layer)
    sender.finish(handle)
    receiver.call("wait", "next")
    got = receiver.call("blocks", [5, 6])
    assert all(torch.equal(g, w) for g, w in zip(got, expected_blocks(SPEC, seed, [7, 8])))


def _record_streams(channel) -> tuple[list, list]:
    """What the pair's control stream (message kinds) and data stream (sizes) carry,
    in issue order, from now on."""
    control, data = [], []
    real_send, real_data = channel.send, channel.data.send

    def record_control(messages, tag=0):
        control.extend(P.parse_control(m)[0] for m in messages if tag == 0)
        return real_send(messages, tag)

    def record_data(tensor):
        data.append(tensor.numel())
        return real_data(tensor)
    channel.send, channel.data.send = record_control, record_data
    return control, data


def test_an_abort_mid_step_pads_its_slots_and_the_rest_of_the_step_lands():
    # One step streams "quit" (2 blocks) and "stay" (3 blocks) to one receiver;
    # "quit" is aborted after layer 0. Every slot the STEP announced still goes out,
    # in its order and size, "quit"'s as padding; its ABORT precedes STEP_SENT, so the
    # receiver never takes the padding for KV; "stay" lands bitwise.
    from pdserve.kv_transfer import TransferAborted
    with _in_process_sender(3) as (receiver, sender):
        control, data = _record_streams(sender._peer(receiver.address).channel)
        receiver.call("expect", "quit", [1, 2])
        receiver.call("expect", "stay", [5, 6, 7])
        quit_ = sender.begin("quit", receiver.address, [3, 4], [1, 2])
        stay = sender.begin("stay", receiver.address, [8, 9, 10], [5, 6, 7])
        assert not sender.announce([quit_, stay])
        assert not sender.send_layers([quit_, stay], 0)
        sender.abort(quit_)
        for layer in range(1, SPEC.num_layers):
            assert not sender.send_layers([quit_, stay], layer)
        sender.finish(stay)
        with pytest.raises(RemoteError) as err:
            receiver.call("wait", "quit")
        assert err.value.kind == TransferAborted.__name__
        receiver.call("wait", "stay")
        got = receiver.call("blocks", [5, 6, 7])
        assert all(torch.equal(g, w) for g, w in zip(got, expected_blocks(SPEC, 3, [8, 9, 10])))
        block = KVLayout.of(sender.kv_caches).block_bytes_per_layer
        assert data == [2 * block, 3 * block] * SPEC.num_layers
        assert control == [P.BEGIN, P.BEGIN, P.STEP, P.ABORT, P.STEP_SENT]


def test_the_abort_that_ends_a_step_pads_it_after_the_layer_being_sent():
    # Step ["gone" (3 blocks), "quit" (2 blocks)]; "gone" is aborted after layer 0,
    # so its slots are padding from then on. Layer 1 is held inside the gather of
    # "quit" when another thread aborts "quit", the step's last live member: that
    # abort pads the rest of the step, and must wait for the pair's lock until layer
    # 1 is out. Padding layer 2 mid-layer would put sizes [3, 2, 3, 3, 2, 2] on the
    # stream, and the receiver's slots of 2 would meet payloads of 3.
    import threading

    from pdserve.kv_transfer import TransferAborted
    with _in_process_sender(3) as (receiver, sender):
        inside, proceed = threading.Event(), threading.Event()
        real_blocks = sender._blocks

        def gated(message, nbytes, cache):
            if quit_.layers_sent == 2:  # layer 1 of "quit", counted, not yet sent
                inside.set()
                proceed.wait(30)
            return real_blocks(message, nbytes, cache)
        sender._blocks = gated
        control, data = _record_streams(sender._peer(receiver.address).channel)
        receiver.call("expect", "gone", [5, 6, 7])
        receiver.call("expect", "quit", [1, 2])
        gone = sender.begin("gone", receiver.address, [8, 9, 10], [5, 6, 7])
        quit_ = sender.begin("quit", receiver.address, [3, 4], [1, 2])
        assert not sender.announce([gone, quit_])
        assert not sender.send_layers([gone, quit_], 0)
        sender.abort(gone)
        layer1 = threading.Thread(target=sender.send_layers, args=([gone, quit_], 1))
        layer1.start()
        assert inside.wait(30)
        aborter = threading.Thread(target=sender.abort, args=(quit_,))
        aborter.start()
        aborter.join(0.5)  # without the pair's lock, the abort pads layer 2 here
        proceed.set()
        layer1.join(30)
        aborter.join(30)
        assert not sender.send_layers([gone, quit_], 2)  # padded out already: a no-op
        block = KVLayout.of(sender.kv_caches).block_bytes_per_layer
        assert data == [3 * block, 2 * block] * SPEC.num_layers
        assert control == [P.BEGIN, P.BEGIN, P.STEP, P.ABORT, P.ABORT, P.STEP_SENT]
        for rid in ("gone", "quit"):
            with pytest.raises(RemoteError) as err:
                receiver.call("wait", rid)
            assert err.value.kind == TransferAborted.__name__
        sender._blocks = real_blocks
        _in_process_transfer_lands(receiver, sender, 3)  # the stream is in step


def test_padding_that_lands_before_its_abort_is_read_is_never_taken_for_kv():
    # The data stream and the control stream are two connections: a transfer aborted
    # after layer 0 has layers 1 and 2 padded, and that padding may land before the
    # receiver reads the ABORT sent ahead of it. Here the receiver reads the ABORT
    # only once every layer landed (a condition on its landings). The transfer must
    # still end ABORTED with its blocks released: it is complete only once its
    # step's STEP_SENT arrived, which follows the ABORT on the control stream.
    import gc
    import threading

    from pdserve.kv_transfer import KVReceiver, KVSender, TransferAborted
    threads_before = set(threading.enumerate())
    def abort_with_its_padding_landed_first() -> None:
        config = TransferConfig(timeout_s=10, connect_timeout_s=20)
        released = []
        receiver = KVReceiver([torch.zeros(SPEC.layer_shape()) for _ in range(SPEC.num_layers)],
                              config, on_release=released.append)
        sender = KVSender("s", sender_cache(SPEC, 5), config)
        landed = threading.Condition()
        real_land, real_fail = receiver._land, receiver._fail

        def land(incoming, layer, payload):
            real_land(incoming, layer, payload)
            with landed:
                landed.notify_all()

        def fail(incoming, error, status, lease=None):
            if isinstance(error, TransferAborted) and "by the sender" in str(error):
                with landed:  # the ABORT is read only after the padding landed
                    assert landed.wait_for(
                        lambda: incoming.layers_landed == SPEC.num_layers, timeout=10)
            return real_fail(incoming, error, status, lease)
        receiver._land, receiver._fail = land, fail
        try:
            receiver.expect("quit", [1, 2])
            handle = sender.begin("quit", receiver.address, [3, 4], [1, 2])
            sender.send_layer(handle, 0)
            sender.abort(handle)  # layers 1 and 2 go as padding
            with pytest.raises(TransferAborted):
                receiver.wait("quit")
            assert released == ["quit"]
        finally:
            sender.close()
            receiver.close()

    abort_with_its_padding_landed_first()
    # With the sender gone its pair's sockets close and the receiver's threads for the
    # pair end: the error wait() raised keeps no reference to the frames it went
    # through (the sender among their locals). They stayed blocked for the rest of the
    # process, and gloo's threads under them aborted the interpreter's exit now and then.
    gc.collect()
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(timeout=10)
    assert not set(threading.enumerate()) - threads_before


def test_a_step_out_of_step_with_a_reservation_ends_only_that_transfer():
    # A sender whose STEP announces a size the receiver did not reserve gets ABORTED
    # with what differed; its payloads are still received, so the data stream stays
    # in step for the next transfer.
    from pdserve.kv_transfer import TransferAborted
    with _in_process_sender(4) as (receiver, sender):
        receiver.call("expect", "odd", [1, 2])
        handle = sender.begin("odd", receiver.address, [3, 4], [1, 2])
        channel = handle.peer.channel
        payload = torch.zeros(5 * KVLayout.of(sender.kv_caches).block_bytes_per_layer,
                              dtype=torch.uint8)
        works = channel.send(P.step_messages([(handle.seq, payload.numel())]))
        works += [channel.data.send(payload) for _ in range(SPEC.num_layers)]
        works += channel.send([P.step_sent_message(1)])
        for work in works:
            work.wait()
        with pytest.raises(RemoteError) as err:
            receiver.call("wait", "odd")
        assert err.value.kind == TransferAborted.__name__
        assert "bytes per layer announced, expected" in str(err.value)
        handle.layers_sent = SPEC.num_layers  # what the sender owes is settled
        with pytest.raises(TransferAborted):
            sender.finish(handle)
        _in_process_transfer_lands(receiver, sender, 4)


def test_nccl_forced_between_cpu_caches_is_refused_before_a_byte_moves():
    receiver = Worker("receiver", "r")
    sender = Worker("sender", "s", config=TransferConfig(timeout_s=10, connect_timeout_s=20,
                                                         backend="nccl"))
    try:
        receiver.call("expect", "gpu-only", [1, 2])
        with pytest.raises(RemoteError) as err:
            sender.call("transfer", [("gpu-only", receiver.address, [3, 4], [1, 2])])
        assert err.value.kind == "LayoutMismatchError"
        assert "backend 'nccl' cannot carry this pair: both KV caches must be on CUDA" in str(
            err.value)
        assert receiver.call("bytes_received") == 0
    finally:
        receiver.stop()
        sender.stop()


def _cuda_pair_roundtrip(receiver_device: str, sender_device: str, backend: str) -> None:
    spec_r = CacheSpec(num_layers=3, dtype="bfloat16", device=receiver_device)
    spec_s = CacheSpec(num_layers=3, dtype="bfloat16", device=sender_device)
    config = TransferConfig(timeout_s=30, connect_timeout_s=60, backend=backend)
    receiver = Worker("receiver", "r", spec_r, config=config)
    sender = Worker("sender", "s", spec_s, seed=6, config=config)
    try:
        jobs = [("a", [5, 1, 17], [9, 20, 3]), ("b", [2, 30], [11, 0])]
        expect_all(receiver, jobs)
        sender.call("transfer", [(rid, receiver.address, src, dst) for rid, src, dst in jobs])
        assert_all_landed(receiver, sender, jobs)
    finally:
        receiver.stop()
        sender.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host staging of CUDA caches "
                    "needs a GPU (this machine has none)")
def test_cuda_caches_on_one_gpu_move_through_pinned_host_memory():
    _cuda_pair_roundtrip("cuda:0", "cuda:0", "auto")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs in one "
                    "machine (this one has fewer)")
def test_cuda_caches_on_two_gpus_move_over_nccl():
    _cuda_pair_roundtrip("cuda:0", "cuda:1", "nccl")
