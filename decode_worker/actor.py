"""The decode worker as a Ray async actor. `steps()` streams one StepBatch per engine
step to its subscriber (the router). A step error its engine cannot pin on requests
ends the process, and Ray restarts the actor (launch sets max_restarts)."""
from __future__ import annotations

import asyncio
import time

import ray

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import exit_for_restart
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker_messages import Reservation, StepBatch
from pdserve.kv_transfer import TransferConfig


@ray.remote
class DecodeWorkerActor:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        self._loop = asyncio.get_event_loop()
        self._batches: asyncio.Queue[StepBatch] = asyncio.Queue()
        self.worker = DecodeWorker(worker_id, engine_config, transfer, on_batch=self._publish,
                                   on_death=exit_for_restart,
                                   kv_host=ray.util.get_node_ip_address())

    def _publish(self, batch: StepBatch) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._batches.put_nowait, batch)

    async def address(self) -> str:
        return self.worker.address

    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, arrival_time: float) -> Reservation | None:
        return await asyncio.wrap_future(
            self.worker.reserve(request_id, prompt_token_ids, params, arrival_time))

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, arrival_time: float) -> None:
        await asyncio.wrap_future(
            self.worker.submit(request_id, prompt_token_ids, params, arrival_time))

    async def start(self, request_id: str, first_token: int) -> None:
        await asyncio.wrap_future(self.worker.start(request_id, first_token))

    async def abort(self, request_id: str) -> None:
        # It waits for the engine's state lock: not on this loop, which streams steps.
        await asyncio.to_thread(self.worker.abort, request_id)

    async def steps(self, stall_timeout_s: float):
        """Every step's new tokens, for as long as the subscriber listens. Steps that
        queued up while the subscriber was busy go out merged, as one batch. While
        idle, an empty batch every quarter of the subscriber's stall bound says the
        engine loop is alive; a loop that died, or made no progress within the bound,
        ends the stream with an error instead."""
        loop = self.worker.loop
        while True:
            try:
                batch = await asyncio.wait_for(self._batches.get(), stall_timeout_s / 4)
            except asyncio.TimeoutError:
                if loop.error is not None:
                    raise RuntimeError(f"engine loop stopped: {loop.error!r}") from None
                if time.monotonic() - loop.progress_at > stall_timeout_s:
                    continue  # no heartbeat: the subscriber declares this worker stalled
                batch = StepBatch(self.worker.worker_id, [])
            while not self._batches.empty():
                batch = batch.merged(self._batches.get_nowait())
            yield batch

    async def stats(self) -> dict:
        return self.worker.stats()

    async def shutdown(self) -> None:
        self.worker.shutdown()
