"""The data plane's pure parts: the backend rule, size-class buffers, the stager's order."""
from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kv_transfer import TransferConfig
from pdserve.kv_transfer.backend import DeviceId, choose
from pdserve.kv_transfer.buffer_pool import MIN_CLASS, BufferPool, size_class
from pdserve.kv_transfer.staging import HostStager

CPU = DeviceId("cpu")
GPU_A, GPU_B = DeviceId("cuda", "GPU-a"), DeviceId("cuda", "GPU-b")


@pytest.mark.parametrize("sender,receiver,want", [
    (CPU, CPU, "gloo"),
    (GPU_A, GPU_B, "nccl"),  # distinct GPUs: GPU to GPU
    (GPU_A, GPU_A, "gloo"),  # one shared GPU: staged through host memory
    (GPU_A, CPU, "gloo"),
])
def test_auto_picks_nccl_only_between_distinct_gpus(sender, receiver, want):
    assert choose("auto", sender, receiver) == want
    assert choose("gloo", sender, receiver) == "gloo"  # always possible, forced


@pytest.mark.parametrize("sender,receiver,why", [
    (CPU, CPU, "must be on CUDA"),
    (GPU_A, CPU, "must be on CUDA"),
    (GPU_A, GPU_A, "the same GPU"),
])
def test_nccl_where_it_cannot_work_is_refused_with_the_reason(sender, receiver, why):
    with pytest.raises(ValueError, match=why):
        choose("nccl", sender, receiver)


def test_a_transfer_config_names_the_backends_it_takes():
    assert TransferConfig(backend="nccl").backend == "nccl"
    with pytest.raises(ValueError, match="backend must be one of"):
        TransferConfig(backend="rdma")


def test_a_device_id_round_trips_through_the_store():
    assert DeviceId.decode(GPU_A.encode().encode()) == GPU_A
    assert DeviceId.of(torch.device("cpu")) == CPU


def test_size_classes_waste_at_most_a_quarter_and_are_their_own_class():
    for nbytes in [1, MIN_CLASS, MIN_CLASS + 1, 5000, 65_537, 3 << 20, (8 << 20) + 7, 10**9]:
        c = size_class(nbytes)
        assert c >= nbytes and size_class(c) == c
        assert c == MIN_CLASS or c <= nbytes * 1.25


def test_prompts_of_varied_lengths_reuse_the_same_buffers():
    pool = BufferPool()
    cpu = torch.device("cpu")
    held = [pool.get(n, cpu) for n in (115_000, 120_000, 130_000)]  # one class
    assert len({t.numel() for t in held}) == 1
    for t in held:
        pool.put(t)
    again = [pool.get(n, cpu) for n in (116_000, 125_000, 131_000)]
    assert {t.data_ptr() for t in again} == {t.data_ptr() for t in held}
    assert (pool.hits, pool.misses) == (3, 3)


def test_the_pool_keeps_no_more_idle_memory_than_its_cap():
    pool = BufferPool(max_bytes=3 * MIN_CLASS)
    buffers = [pool.get(MIN_CLASS, torch.device("cpu")) for _ in range(5)]
    for b in buffers:
        pool.put(b)
    assert pool.idle_bytes == 3 * MIN_CLASS
    with pytest.raises(ValueError, match="did not come from this pool"):
        pool.put(torch.empty(MIN_CLASS + 1, dtype=torch.uint8))


class _Ready:
    """A CUDA event's boundary: synchronize() returns once it fired."""

    def __init__(self):
        self.fired = threading.Event()

    def synchronize(self):
        assert self.fired.wait(30)


def test_the_stager_sends_in_submission_order_each_once_its_copy_is_done():
    stager = HostStager()
    sent = []
    first, second = _Ready(), _Ready()
    a = stager.submit(first, lambda: sent.append("a") or "a")
    b = stager.submit(second, lambda: sent.append("b") or "b")
    second.fired.set()  # the later copy finishes first: its send still waits its turn
    assert not a.done() and not b.done() and sent == []
    first.fired.set()
    assert (a.result(30), b.result(30)) == ("a", "b") and sent == ["a", "b"]

    def broken():
        raise RuntimeError("pair lost")
    done = _Ready()
    done.fired.set()
    with pytest.raises(RuntimeError, match="pair lost"):
        stager.submit(done, broken).result(30)
    assert stager.submit(done, lambda: "still serving").result(30) == "still serving"
    stager.close()


def test_a_staged_send_that_outlives_its_deadline_reads_as_a_timeout():
    # A Future's TimeoutError carries no message: it must still count as a timeout
    # (TransferTimeout), not as a lost peer.
    from concurrent.futures import Future

    from pdserve.kv_transfer.sender import _Inflight, _is_timeout
    never: Future = Future()
    with pytest.raises(TimeoutError) as err:
        _Inflight(never).wait(deadline=0.0)
    assert _is_timeout(err.value)


class _RecordingStream:
    """The data stream's boundary (data_plane.py, tested for real over gloo in
    test_kv_transfer.py): records receives in posting order."""
    device = torch.device("cpu")

    def __init__(self):
        self.posted: list[int] = []

    def post_recv(self, tensor):
        self.posted.append(tensor.numel())
        return len(self.posted)


def test_a_step_is_posted_ahead_up_to_the_window_then_one_per_landing():
    from pdserve.kv_transfer.receive_window import ReceiveWindow, Slot
    stream = _RecordingStream()
    window = ReceiveWindow(stream, BufferPool(), window_bytes=10_000)
    sizes = [4_000, 5_000, 3_000, 6_000]
    window.plan([Slot(None, i, n) for i, n in enumerate(sizes)])
    assert stream.posted == [4_000, 5_000]  # a third would pass the window
    slot, work, buffer = window.next()
    assert (slot.layer, work, buffer.numel() >= 4_000) == (0, 1, True)
    window.landed(slot)
    assert stream.posted == [4_000, 5_000, 3_000]  # 8k posted; 6k more would pass it
    slot, _, _ = window.next()
    window.landed(slot)
    assert stream.posted == [4_000, 5_000, 3_000, 6_000]


def test_a_payload_larger_than_the_window_is_still_posted_alone():
    from pdserve.kv_transfer.receive_window import ReceiveWindow, Slot
    stream = _RecordingStream()
    window = ReceiveWindow(stream, BufferPool(), window_bytes=1)
    window.plan([Slot(None, 0, 8_000), Slot(None, 1, 8_000)])
    assert stream.posted == [8_000]
    slot, _, _ = window.next()
    window.landed(slot)
    assert stream.posted == [8_000, 8_000]
    window.close()
    assert window.next()[0].layer == 1 and window.next() is None


def test_a_step_of_hundreds_of_transfers_round_trips_through_its_messages():
    from pdserve.kv_transfer import protocol as P
    members = [(seq, seq * 4096) for seq in range(1, 301)]  # 4.8 KB: an extension
    messages = P.step_messages(members)
    assert len(messages) == 2 and all(m.numel() == P.CONTROL_BYTES for m in messages)
    kind, count, inline, extension, body = P.parse_control(messages[0])
    body += bytes(messages[1].numpy())
    assert (kind, count) == (P.STEP, 300)
    assert P.step_members(count, body[:inline + extension]) == members
    with pytest.raises(ValueError, match="300 transfers carried"):
        P.step_members(count, body[:inline])
