"""deploy/ray/local.yaml run on this machine: its head and worker `ray start` commands
on loopback, then its head's `pdserve serve` command line, literally (through bash,
keys sourced from ~/pdserve.env), with the cluster-specific values overridden.

What is changed, and why:
- `ray stop` and the `pkill` of an earlier router are skipped: they act on every Ray
  and pdserve process of the machine, not only this test's;
- the GCS port is a free one instead of 6379, and $RAY_HEAD_IP is 127.0.0.1;
- `--autoscaling-config=~/ray_bootstrap_config.yaml` is dropped: that file is written
  by `ray up`, and the local provider's monitor would SSH to the worker_ips;
- each `ray start` gets `--block` (the test owns its processes and ends them) and a
  temp dir of its own (the machine's default Ray session is left alone);
- `pdserve serve` gets flags appended (the last wins): the tiny test model on the CPU,
  ports 0 on loopback, this cluster's address, and SLOs a shared CPU can keep.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.files import LAUNCHERS, load
from tests.polling import until

KEY = "deploy-test-key"


@dataclass(frozen=True, kw_only=True)
class LocalCluster:
    http_url: str
    grpc_target: str
    api_key: str
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_yaml() -> dict:
    return load(next(p for p in LAUNCHERS if load(p)["provider"]["type"] == "local"))


def _ray_start(command: str, port: int, temp_dir: Path) -> str:
    command = command.replace("--port=6379", f"--port={port}").replace(
        "$RAY_HEAD_IP:6379", f"$RAY_HEAD_IP:{port}")
    command = re.sub(r"\s--autoscaling-config=\S+", "", command)
    assert "ray start" in command, command
    return f"{command} --block --temp-dir={temp_dir}"


def _kill_tree(sessions: list[subprocess.Popen], temp_dir: Path,
               grace_s: float = 5.0) -> None:
    """End every process of the test's Ray nodes: their sessions (SIGTERM, and SIGKILL
    for what is left after `grace_s` in all: the router, whose drain is what matters,
    stopped before; `ray start --block` on the head outlasted 20 s of SIGTERM in every
    run, and killed it left nothing behind), then any process whose command line names
    the nodes' temp dir (Ray's workers)."""
    for process in sessions:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for process in sessions:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(temp_dir) in (proc / "cmdline").read_text():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture(scope="package")
def local_cluster(llama_dir):
    config = _local_yaml()
    home = Path(tempfile.mkdtemp(prefix="pdh"))
    temp_dir = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp"))  # short: socket paths
    (home / "pdserve.env").write_text(f"PDSERVE_API_KEY={KEY}\n")
    port = _free_port()
    # `ray` and `pdserve` as a node's shell finds them: this environment's
    env = {**os.environ, "HOME": str(home), "RAY_HEAD_IP": "127.0.0.1",
           "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    sessions: list[subprocess.Popen] = []

    def start(command: str, log: str) -> subprocess.Popen:
        process = subprocess.Popen(["bash", "-c", command], env=env, start_new_session=True,
                                   stdout=open(home / log, "w"), stderr=subprocess.STDOUT)
        sessions.append(process)
        return process

    head = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    serve = [c for c in config["head_start_ray_commands"] if "pdserve serve" in c
             and "pkill" not in c]
    workers = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert len(head) == len(serve) == len(workers) == 1
    try:
        ray_head = start(_ray_start(head[0], port, temp_dir), "head.log")
        until(lambda: _answers(port) or ray_head.poll() is not None, timeout_s=60)
        assert _answers(port), _read(home / "head.log")
        start(_ray_start(workers[0], port, temp_dir), "worker.log")
        overrides = (f" --model {llama_dir} --served-model-name test-llama --device cpu"
                     f" --dtype float32 --num-gpus-per-worker 0 --max-model-len 512"
                     f" --kv-cache-memory-bytes {32 << 20} --host 127.0.0.1 --grpc-port 0"
                     f" --http-port 0 --ray-address 127.0.0.1:{port}"
                     f" --slo-ttft-ms 10000 --slo-tpot-ms 2000")
        command, redirect, rest = serve[0].partition(" > ~/pdserve.log")
        assert redirect and rest.rstrip().endswith("&"), serve[0]
        start(f"{command}{overrides}{redirect}{rest} echo $! > ~/pdserve.pid",
                       "serve.log")
        log, pid = home / "pdserve.log", home / "pdserve.pid"

        def serving_or_gone():
            return (re.search(r"gRPC (\S+)  HTTP (\S+)", _read(log))
                    or (_read(pid).strip() and not _alive(int(_read(pid)))))

        serving = until(serving_or_gone, timeout_s=300)
        assert isinstance(serving, re.Match), _read(log)[-3000:]
        yield LocalCluster(grpc_target=serving.group(1), http_url=serving.group(2),
                           api_key=KEY, log=log)
    finally:
        if _read(home / "pdserve.pid").strip():
            _stop_router(int(_read(home / "pdserve.pid")))
        _kill_tree(sessions, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _stop_router(pid: int) -> None:
    """SIGTERM, as the next `ray up` does: the router drains and exits."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not until(lambda: not _alive(pid), timeout_s=60):
        os.kill(pid, signal.SIGKILL)
