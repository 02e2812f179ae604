"""A real redis-server for the tests (the Makefile installs it): on a free loopback
port, no persistence, killed and started again on the same port by fault tests."""
from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.polling import until


class RedisServer:
    def __init__(self, directory: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `make test` installs it "
                        "(Debian: apt-get install redis-server)")
        self.binary, self.directory = binary, directory
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Starts it (on the port it had, once it had one), answering PING on return."""
        for _ in range(5):  # a free port taken between the check and the bind: another
            port = self.port or _free_port()
            self.process = subprocess.Popen(
                [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            until(lambda: _pong(port) or self.process.poll() is not None, timeout_s=10)
            if _pong(port):
                self.port = port
                return
            self.process.kill()
            self.process.wait()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
