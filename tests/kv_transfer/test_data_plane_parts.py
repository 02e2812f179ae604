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
