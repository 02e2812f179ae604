"""Worker processes holding a real KV cache and a KVSender or KVReceiver, driven over a
pipe so a test can run several sides at once. Sender caches hold seeded random data the
test can recompute; receiver caches start at zero."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int = 3
    num_blocks: int = 32
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"  # the caches' (the CUDA tests place each side on its own GPU)

    def layer_shape(self):
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def sender_cache(spec: CacheSpec, seed: int) -> list[torch.Tensor]:
    """On the CPU (what a test compares against); the worker moves it to spec.device."""
    dtype = getattr(torch, spec.dtype)
    return [torch.randn(spec.layer_shape(), generator=torch.Generator().manual_seed(seed * 100 + i))
            .to(dtype) for i in range(spec.num_layers)]


def _main(role: str, name: str, spec: CacheSpec, seed: int, config: TransferConfig, conn):
    torch.set_num_threads(1)
    dtype = getattr(torch, spec.dtype)
    released = _Released()
    if role == "receiver":
        caches = [torch.zeros(spec.layer_shape(), dtype=dtype, device=spec.device)
                  for _ in range(spec.num_layers)]
        side = KVReceiver(caches, config, on_release=released.append)
        _notify_landings(side)
        conn.send(side.address)
    else:
        caches = [c.to(spec.device) for c in sender_cache(spec, seed)]
        side = KVSender(name, caches, config)
        conn.send(None)
    while True:
        command, args = conn.recv()
        try:
            conn.send(("ok", _COMMANDS[command](side, caches, released, *args)))
        except Exception as exc:
            conn.send(("err", (type(exc).__name__, str(exc))))


class _Released(list):
    """Request ids the receiver handed back, in order; a test can wait for one."""

    def __init__(self):
        super().__init__()
        self._cv = threading.Condition()

    def append(self, request_id: str) -> None:
        with self._cv:
            super().append(request_id)
            self._cv.notify_all()

    def wait_for(self, request_id: str, timeout: float) -> list[str]:
        with self._cv:
            self._cv.wait_for(lambda: request_id in self, timeout)
            return list(self)


def _transfer(sender: KVSender, caches, released, jobs, layer_delay=0.0, stop_after=None,
              then="finish"):
    """Interleaved transfers, as one prefill step sends them: begin all jobs, announce
    them together, send layer by layer round-robin."""
    handles = [sender.begin(*job) for job in jobs]
    _raise_first(sender.announce(handles))
    for layer in range(len(caches)):
        if stop_after is not None and layer == stop_after:
            if then == "abort":
                for h in handles:
                    sender.abort(h)
                return "aborted"
            time.sleep(3600)  # hang mid-transfer until the test kills this process
        _raise_first(sender.send_layers(handles, layer))
        time.sleep(layer_delay)
    return [sender.finish(h).bytes_sent for h in handles]


def _urgent_copies(sender: KVSender, caches, released, address, jobs):
    """Live migration's last copies, as a worker's PrefillRole sends them: queued as
    urgent while its lane to the receiver is busy, then sent. Returns each copy's
    bytes and how many transfers each announced step held."""
    from pdserve.prefill_worker.role import PrefillRole

    role = PrefillRole(None, sender)  # send() needs no engine loop
    role.connect([address])
    busy, steps = threading.Event(), []
    announce = sender.announce

    def counted(handles):
        steps.append(len(handles))
        return announce(handles)
    sender.announce = counted
    held = role._lane(address).submit(busy.wait, 30)
    copies = [role.send(rid, address, src, dst, urgent=True) for rid, src, dst in jobs]
    busy.set()
    held.result(30)
    return [c.result(30) for c in copies], steps


def _raise_first(failures: dict) -> None:
    if failures:
        raise next(iter(failures.values()))


def _notify_landings(receiver: KVReceiver) -> None:
    """A hook at the receiver's landing boundary: each layer landed notifies waiters."""
    receiver.landed_cv = threading.Condition()
    receiver.layers_landed = {}
    land = receiver._land

    def landed(incoming, layer, payload):
        land(incoming, layer, payload)
        with receiver.landed_cv:
            receiver.layers_landed[incoming.request_id] = incoming.layers_landed
            receiver.landed_cv.notify_all()
    receiver._land = landed


def _wait_landed(receiver: KVReceiver, caches, released, request_id, layers, timeout):
    """Returns once `layers` layers of the request have landed."""
    with receiver.landed_cv:
        if not receiver.landed_cv.wait_for(
                lambda: receiver.layers_landed.get(request_id, 0) >= layers, timeout):
            raise TimeoutError(f"{request_id}: {layers} layers did not land in {timeout}s")
        return receiver.layers_landed[request_id]


def _blocks(receiver: KVReceiver, caches, released, block_ids):
    return [c[:, block_ids].cpu() for c in caches]


def _pairs_ended(receiver: KVReceiver, caches, released, timeout):
    """Waits for every pair's landing thread to end (its pair ended: the thread ends
    after the pair is forgotten); returns the pairs still open."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name.startswith("kv-land-"):
            thread.join(max(deadline - time.monotonic(), 0))
    return len(receiver._pairs)


_COMMANDS = {
    "transfer": _transfer,
    "urgent_copies": _urgent_copies,
    "expect": lambda r, c, rel, *a: r.expect(*a),
    "wait": lambda r, c, rel, *a: r.wait(*a),
    "abort": lambda r, c, rel, rid: r.abort(rid),
    "blocks": _blocks,
    "wait_landed": _wait_landed,
    "released": lambda r, c, rel: list(rel),
    "wait_released": lambda r, c, rel, rid, timeout: rel.wait_for(rid, timeout),
    "lease_expiries": lambda r, c, rel: dict(r.lease_expiries),
    "bytes_received": lambda r, c, rel: r.bytes_received,
    "pending": lambda r, c, rel: r.num_pending,
    "pairs_ended": _pairs_ended,
}


class RemoteError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Worker:
    def __init__(self, role: str, name: str, spec: CacheSpec = CacheSpec(), seed: int = 0,
                 config: TransferConfig = TransferConfig(timeout_s=10, connect_timeout_s=20)):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(role, name, spec, seed, config, child),
                                   daemon=True)
        self.process.start()
        self.address = self._reply(60)
        self.spec, self.seed = spec, seed

    def call(self, command: str, *args, timeout: float = 60):
        self.start(command, *args)
        return self.result(timeout)

    def start(self, command: str, *args) -> None:
        self.conn.send((command, args))

    def result(self, timeout: float = 60):
        status, value = self._reply(timeout)
        if status == "err":
            raise RemoteError(*value)
        return value

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker gave no answer within {timeout}s")
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.process.pid, 9)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
