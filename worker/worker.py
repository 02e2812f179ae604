"""One worker: an engine on its own loop thread, a KV sender and a KV receiver, and
the two roles over them (prefill_worker.role, decode_worker.role). Its role —
prefill, decode or both (whole requests, prefill included) — says which calls it
takes, and changes at run time once nothing is in flight (the weights stay loaded).

A tensor-parallel worker is rank 0 of its group: its engine leads the other ranks
(`tp_group`), each of which sends and receives its own KV heads (`rank_links`,
worker/rank_kv.py).

Every step it publishes one StepBatch: the deltas of the requests it decodes and its
telemetry (WorkerTelemetry). Outputs of its prefill jobs go to the prefill role,
which answers them through prefill()'s future instead.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from pdserve.decode_worker.moves import Moves
from pdserve.decode_worker.role import DecodeRole, abort_on_ranks, deltas
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.profile import profile
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.telemetry import gauges, report
from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig
from pdserve.prefill_worker.role import PrefillRole
from pdserve.worker.core import WorkerCore
from pdserve.worker.messages import (
    BlockCopy,
    IncomingCopy,
    Job,
    PrefillJob,
    StepBatch,
    TokenDelta,
    WorkerTelemetry,
    check_role,
)

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, worker_id: str, engine_config: EngineConfig,
                 transfer: TransferConfig = TransferConfig(), role: str = "decode",
                 on_batch: Callable[[StepBatch], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None,
                 kv_host: str = "127.0.0.1", tp_group: TensorParallelGroup | None = None,
                 rank_links: tuple = ()):
        """kv_host: the address its KV rendezvous and pairs bind (the node's, on a
        cluster). on_batch(batch) runs on the engine thread. tp_group, rank_links:
        rank 0's group and its links to ranks 1.. (tensor_parallel_size > 1)."""
        self.worker_id = worker_id
        self.core = WorkerCore(worker_id, role, time.monotonic, transfer.begin_lease_s)
        self.on_batch = on_batch
        self._on_death = on_death
        self.links = tuple(rank_links)
        engine = LLMEngine(engine_config, tp_group=tp_group)
        try:
            profile(engine)  # warm, and the latency model's first measurements
        except BaseException:
            engine.close()
            raise
        engine.block_manager.record_prefix_events = True  # reported in telemetry
        self.sender = KVSender(worker_id, engine.runner.kv_caches, transfer, kv_host)
        self.receiver = KVReceiver(engine.runner.kv_caches, transfer, kv_host,
                                   on_release=self._release)
        self._engine = engine
        if self.links:  # pairing senders find every rank through rank 0's rendezvous
            self.receiver.publish_ranks([link.address(transfer.connect_timeout_s)
                                         for link in self.links])
        self._reported_steps = 0
        # The loop thread calls its callbacks only once a role has given it work.
        self.loop = EngineLoop(engine, on_step=self._on_step, export=self._export,
                               on_death=on_death)
        model = engine.model_config
        self.prefill_role = PrefillRole(self.loop, self.sender, self.links,
                                        (model.num_heads, model.num_kv_heads))
        self.decode_role = DecodeRole(self.loop, self.receiver, self.core,
                                      self._publish_deltas, self.links, self._release)
        self.moves = Moves(self.loop, self.receiver, self.prefill_role.send,
                           self._publish_deltas, self.links, self._release)

    @property
    def role(self) -> str:
        return self.core.role

    @property
    def address(self) -> str:
        """Its KV rendezvous, which prefill-capable workers pair with."""
        return self.receiver.address

    # ---- the roles' calls -------------------------------------------------------

    def prepare(self, params: SamplingParams) -> None:
        """A job's parameters prepared before its call (LLMEngine.prepare): the actor
        runs this in a thread of its own, off the engine's thread and state lock."""
        self.loop.engine.prepare(params)

    def prefill(self, job: PrefillJob) -> Future:
        self.core.require("prefill")
        return self.prefill_role.prefill(job)

    def connect(self, receiver_addresses: list[str]) -> None:
        self.prefill_role.connect(receiver_addresses)

    def disconnect(self, receiver_addresses: list[str]) -> None:
        """Closes its pairs with decode workers that left or stopped decoding."""
        self.prefill_role.disconnect(receiver_addresses)

    def reserve(self, job: Job) -> Future:
        self.core.require("reserve")
        return self.decode_role.reserve(job)

    def start(self, request_id: str, first_token: int, choices: Sequence[int] = ()) -> Future:
        return self.decode_role.start(request_id, first_token, choices)

    def submit(self, job: Job) -> Future:
        self.core.require("submit")
        return self.decode_role.submit(job)

    # ---- live migration (decode_worker/moves.py) ---------------------------------

    def take_over(self, job: Job) -> Future:
        self.core.require("take_over")
        return self.decode_role.reserve(job, expect=False)

    def expect_copy(self, incoming: IncomingCopy) -> list[int]:
        return self.moves.expect_copy(incoming)

    def send_blocks(self, copy: BlockCopy) -> Future:
        return self.moves.send_blocks(copy)

    def pause(self, request_id: str) -> Future:
        return self.moves.pause(request_id)

    def abort(self, request_id: str) -> None:
        """Frees whatever the request holds here, in either role."""
        if not self.prefill_role.abort(request_id):
            self.decode_role.abort(request_id)

    def set_role(self, role: str) -> None:
        """Changes the role; refused (WorkerBusyError) while any request is here. In
        role decode it sends no KV: its pairs as a sender close (the receivers' sides
        end with them)."""
        check_role(role)  # before the engine is asked

        def flip(engine: LLMEngine) -> None:
            self.core.change_role(
                role, engine.scheduler.num_unfinished or int(self.prefill_role.busy))
        self.loop.call_concurrent(flip)
        if role == "decode":
            self.prefill_role.disconnect()

    # ---- what it reports --------------------------------------------------------

    def telemetry(self) -> WorkerTelemetry:
        """Its load now, with the steps and prefix-cache events since the last call."""
        return self.loop.call_concurrent(self._measure)

    def stats(self) -> dict:
        t = self.loop.call_concurrent(lambda engine: gauges(
            self.worker_id, self.role, engine.scheduler, time.time()))
        return {**t, "kv_cache_usage": 1 - t["free_blocks"] / t["num_blocks"],
                "lease_expiries": dict(self.receiver.lease_expiries)}

    def shutdown(self) -> None:
        """Its loop, roles and transfers end; a tensor-parallel engine's other ranks
        are told to stop (their owner removes them)."""
        self.loop.stop()
        self.prefill_role.shutdown()
        self.decode_role.shutdown()
        self.sender.close()
        self.receiver.close()
        self._engine.close()

    def _release(self, request_id: str) -> None:
        """A request's reserved blocks go back (an ending transfer, an abort): its KV
        stops landing on the other ranks first. A rank that cannot be reached might
        still write into them: they stay held, and the worker is lost (on_death)."""
        try:
            abort_on_ranks(self.links, request_id)
        except Exception as exc:
            log.critical("worker %s: a tensor-parallel rank did not confirm the end of "
                         "request %s's KV: %r", self.worker_id, request_id, exc)
            if self._on_death is not None:
                self._on_death(exc)
            return
        self._engine.abort(request_id)

    # ---- on the engine thread -----------------------------------------------------

    def _export(self, out):
        return self.prefill_role.export(out)

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        mine = [self.prefill_role.owns(o.request_id) for o in outputs]
        if any(mine):
            self.prefill_role.on_step([o for o, m in zip(outputs, mine) if m])
            outputs = [o for o, m in zip(outputs, mine) if not m]
        if self.on_batch is not None:
            self.on_batch(StepBatch(worker_id=self.worker_id, deltas=deltas(outputs),
                                    telemetry=self.telemetry()))

    def _publish_deltas(self, items: list[TokenDelta]) -> None:
        if self.on_batch is not None:
            self.on_batch(StepBatch(worker_id=self.worker_id, deltas=items))

    def _measure(self, engine: LLMEngine) -> WorkerTelemetry:
        new = engine.num_steps - self._reported_steps
        self._reported_steps = engine.num_steps
        steps = tuple(engine.step_timings)[-new:] if new else ()
        return report(self.worker_id, self.role, engine.scheduler, time.time(),
                                steps)


