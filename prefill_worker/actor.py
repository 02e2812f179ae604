"""The prefill worker as a Ray async actor (resources set with .options()). A step
error its engine cannot pin on requests ends the process, and Ray restarts the actor
(launch sets max_restarts)."""
from __future__ import annotations

import asyncio

import ray

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import exit_for_restart
from pdserve.engine.worker_messages import PrefillJob, PrefillResult
from pdserve.kv_transfer import TransferConfig
from pdserve.prefill_worker.worker import PrefillWorker


@ray.remote
class PrefillWorkerActor:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        self.worker = PrefillWorker(worker_id, engine_config, transfer,
                                    on_death=exit_for_restart,
                                    kv_host=ray.util.get_node_ip_address())

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        return await asyncio.wrap_future(self.worker.prefill(job))

    async def connect(self, receiver_addresses: list[str]) -> None:
        await asyncio.to_thread(self.worker.connect, receiver_addresses)

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def shutdown(self) -> None:
        self.worker.shutdown()
