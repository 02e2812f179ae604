"""Runs a Router and its front ends on an event loop in a background thread, so a
CLI or a test can start and stop the whole thing from ordinary code."""
from __future__ import annotations

import asyncio
import logging
import threading

import uvicorn

from pdserve.router.config import TLSConfig
from pdserve.router.front.auth import ApiKeys
from pdserve.router.front.grpc_server import start_grpc_server
from pdserve.router.front.http_server import create_app
from pdserve.router.router import Router

log = logging.getLogger(__name__)


class RouterServer:
    # What the router's own stop (its Redis loops, the pool's supervision) may take
    # once the front ends drained; past it, stop() reports what still runs and raises.
    stop_margin_s = 10.0

    def __init__(self, router: Router, host: str = "127.0.0.1", grpc_port: int = 0,
                 http_port: int = 0, keys: ApiKeys = ApiKeys(), tls: TLSConfig | None = None,
                 admin_keys: ApiKeys = ApiKeys()):
        """admin_keys: serve the admin API (/admin), behind these keys."""
        self.router = router
        self.host = host
        self.keys, self.tls, self.admin_keys = keys, tls, admin_keys
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router",
                                        daemon=True)
        self._thread.start()
        self._grpc, self.grpc_port = self._run(self._start_grpc(grpc_port), timeout=30)
        self._http, self.http_port = self._run(self._start_http(http_port), timeout=30)

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'http' if self.tls is None else 'https'}://{self.host}:{self.http_port}"

    async def _start_grpc(self, port: int):
        await self.router.start()
        return await start_grpc_server(self.router, self.host, port, self.keys, self.tls)

    async def _start_http(self, port: int):
        tls = {} if self.tls is None else {"ssl_certfile": self.tls.certfile,
                                           "ssl_keyfile": self.tls.keyfile}
        self.app = create_app(self.router, self.keys, self.admin_keys)
        config = uvicorn.Config(self.app, host=self.host, port=port,
                                log_level="warning", lifespan="off", **tls)
        server = uvicorn.Server(config)
        self._http_task = self.loop.create_task(server.serve())
        while not server.started:
            if self._http_task.done():
                self._http_task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        return server, server.servers[0].sockets[0].getsockname()[1]

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _refuse_http(self) -> None:
        """New connections refused, idle keep-alive ones closed, busy ones closed once
        their response is sent: what uvicorn's shutdown does first, done now rather
        than on its next tick (up to 0.1 s later)."""
        for listener in self._http.servers:
            listener.close()
        for connection in list(self._http.server_state.connections):
            connection.shutdown()

    def stop(self, grace_s: float = 5.0) -> None:
        """Drains: both front ends stop taking requests at once (new HTTP connections
        refused, new gRPC calls UNAVAILABLE), admin operations under way are answered
        503, in-flight streams get `grace_s` to finish, then the loop stops. A drain
        that outlasts its bound raises TimeoutError, once the stack of every task it
        left running is logged."""
        async def shutdown():
            self.router.pool.close()
            # A connection that never finishes (a TLS handshake a client dropped, an
            # idle keep-alive) must not hold the drain past its grace.
            self._http.config.timeout_graceful_shutdown = grace_s
            self._refuse_http()
            self._http.should_exit = True  # uvicorn's own shutdown, on its next tick
            await asyncio.gather(self._grpc.stop(grace_s),  # refuses new calls now
                                 asyncio.wait_for(self._http_task, grace_s + 5))
            await self.router.stop()
            self.app.state.body_parser.close()
        try:
            self._run(shutdown(), timeout=grace_s + self.stop_margin_s)
        except TimeoutError:
            try:
                running = self._run(_running_tasks(), timeout=5)
            except TimeoutError:
                running = "nothing answers: a call blocks the loop's thread"
            log.error("the drain did not end within %g s; still running:\n%s",
                      grace_s + self.stop_margin_s, running)
            raise
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


async def _running_tasks() -> str:
    """Every task on the loop but the caller's, each with its chain of awaits (the
    innermost last), as text."""
    text = []
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            text.append(f"{task.get_name()}:")
            text += _awaits(task.get_coro())
    return "\n".join(text)


def _awaits(coro) -> list[str]:
    """Where a coroutine (or async generator) and each one it awaits stand."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, '
                     f"in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return lines
