"""A `pdserve` command run as users run it (a subprocess), with its output read as it
comes and kept, and a SIGTERM stop that, when the process outlives its bound, ends it
with every thread's stack printed (faulthandler on SIGABRT) so the failure says where
it was stuck."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from typing import Iterator

import pytest

LINE_TIMEOUT_S = 120.0  # a server that prints nothing for this long is stuck


class Output:
    """One pipe, read to its end in a thread: every line kept, and handed out in order."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._reader.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def __iter__(self) -> Iterator[str]:
        """The lines not handed out yet, until the pipe ends (each wait bounded)."""
        while (line := self._queue.get(timeout=LINE_TIMEOUT_S)) is not None:
            yield line

    def ended(self, timeout_s: float) -> bool:
        self._reader.join(timeout_s)
        return not self._reader.is_alive()

    def tail(self, chars: int = 6000) -> str:
        return "".join(self.lines)[-chars:]


class FrontProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        """`env`: the process's environment (default: this one's)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1",
                 "PYTHONFAULTHANDLER": "1"})
        self.stdout, self.stderr = Output(self.process.stdout), Output(self.process.stderr)

    def serving(self) -> tuple[str, str]:
        """The gRPC target and HTTP URL the process printed once it served."""
        pattern = re.compile(r"gRPC (\S+)  HTTP (\S+)")
        try:
            match = next((m for m in map(pattern.search, self.stdout) if m), None)
        except queue.Empty:
            pytest.fail(f"it printed nothing for {LINE_TIMEOUT_S:g} s before it served:\n"
                        f"{self.stderr.tail()}")
        assert match, f"it ended before it served:\n{self.stderr.tail()}"
        return match.group(1), match.group(2)

    def terminate(self, timeout_s: float) -> int:
        """SIGTERM, and its exit code within timeout_s (`exit_code`)."""
        self.process.send_signal(signal.SIGTERM)
        return self.exit_code(timeout_s)

    def exit_code(self, timeout_s: float) -> int:
        """The exit code within timeout_s; past it, the process is aborted and the test
        fails showing its thread stacks and its output."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)  # faulthandler prints the stacks
            self.process.wait(timeout=30)
            self.stderr.ended(10)
            self.stdout.ended(10)
            pytest.fail(f"still running after {timeout_s:g} s.\nstdout:\n"
                        f"{self.stdout.tail(2000)}\nstderr:\n{self.stderr.tail()}")

    def tracebacks(self) -> str:
        """The process's stderr when a traceback is in it, else empty."""
        return self.stderr.tail() if any("Traceback" in line
                                          for line in self.stderr.lines) else ""

    def __enter__(self) -> FrontProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
