"""Runs a Router and its front ends on an event loop in a background thread, so a
CLI or a test can start and stop the whole thing from ordinary code."""
from __future__ import annotations

import asyncio
import threading

from router.grpc_server import start_grpc_server
from router.router import Router


class RouterServer:
    def __init__(self, router: Router, host: str = "127.0.0.1", grpc_port: int = 0):
        self.router = router
        self.host = host
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router",
                                        daemon=True)
        self._thread.start()
        self._grpc, self.grpc_port = self._run(self._start(grpc_port), timeout=30)

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    async def _start(self, grpc_port: int):
        await self.router.start()
        return await start_grpc_server(self.router, self.host, grpc_port)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 5.0) -> None:
        """Drains: in-flight streams get `grace_s` to finish, then the loop stops."""
        async def shutdown():
            await self._grpc.stop(grace_s)
            await self.router.stop()
        self._run(shutdown(), timeout=grace_s + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
