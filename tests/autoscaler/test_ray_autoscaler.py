"""Ray's autoscaler follows the pool: a cluster of Ray's own fake multi-node provider
(`ray start --head --autoscaling-config`, its nodes local raylets) whose head holds
the first two workers. A worker added beyond them does not fit what is free: it is
listed pending, the router asks the autoscaler for the whole pool's bundles
(request_resources), a node is added and the worker placed on it. Once that worker is
removed the request shrinks, and the node, idle, is taken away."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import ray

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.front.auth import ApiKeys
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.polling import until

ADMIN_KEY = "admin-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(gcs_address: str) -> dict:
    """Ray's fake_multinode example, with a 1-CPU head and up to two 1-CPU nodes."""
    return {
        "cluster_name": "pdserve-fake", "max_workers": 2,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {},
                                 "max_workers": 0},
            "ray.worker.cpu": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0,
                               "max_workers": 2}},
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1, "docker": {}, "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": []}


def _processes_under(marker: str) -> list[int]:
    """Every process whose command line names our temp dir: the head's and the fake
    nodes' Ray processes (some of which ignore SIGTERM)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def fake_cluster():
    temp = tempfile.mkdtemp(prefix="pdfake-", dir="/tmp")  # short: Ray's socket paths
    ip = ray.util.get_node_ip_address()
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    # The port is free when picked, but another process may take it before the head's
    # GCS binds it (once, the GCS aborted and ray.init waited until pytest's timeout):
    # the head is started again on a fresh port until its GCS listens.
    for _ in range(3):
        port = _free_port()
        config = Path(temp) / "autoscaling.json"
        config.write_text(json.dumps(_config(f"{ip}:{port}")))
        head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp}",
             "--include-dashboard=false", "--num-cpus=1", f"--autoscaling-config={config}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if _started(head, 90):
            break
        _stop_head(head, temp)
    else:
        pytest.fail("the fake cluster's head did not start on any of three ports")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the head has none: see shared research
    try:
        ray.init(address=f"{ip}:{port}", log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        _stop_head(head, temp)
        shutil.rmtree(temp, ignore_errors=True)


def _started(head: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `ray start --block` said the runtime started (it exits when its GCS
    cannot bind the port) within timeout_s; its output is read to the end meanwhile."""
    started = threading.Event()

    def read() -> None:
        for line in head.stdout:
            if "Ray runtime started" in line:
                started.set()
    threading.Thread(target=read, daemon=True).start()
    return started.wait(timeout_s) and head.poll() is None


def _stop_head(head: subprocess.Popen, temp: str) -> None:
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(20)
    except subprocess.TimeoutExpired:
        head.kill()
    for pid in _processes_under(temp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def _requested() -> list[dict]:
    """What the router last asked of the (v1) autoscaler, as Ray keeps it."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def test_a_worker_that_finds_no_room_gets_a_node_and_the_idle_node_goes(fake_cluster,
                                                                        llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=16 << 20,
                                      max_model_len=512)
    router = launch(config, PoolSpec(1, 1, num_cpus_per_worker=0.5), TransferConfig(),
                    RouterConfig(startup_timeout_s=120), served_model_name="test-llama")
    srv = RouterServer(router, admin_keys=ApiKeys((ADMIN_KEY,)))
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        assert _alive_nodes() == 1
        added = httpx.post(f"{srv.http_url}/admin/workers", json={"role": "decode"},
                           headers=headers, timeout=30)
        assert added.status_code == 202 and added.json()["state"] == "pending", added.text
        worker_id = added.json()["worker_id"]

        def state() -> str:
            return httpx.get(f"{srv.http_url}/admin/workers/{worker_id}", headers=headers,
                             timeout=30).json().get("state", "")
        assert until(lambda: state() in ("serving", "failed"), 120), state()
        assert state() == "serving"
        assert _alive_nodes() == 2  # the autoscaler added the node it waited for
        # the whole pool, not an increment (the request goes out off the loop)
        assert until(lambda: _requested() == [{"CPU": 0.5}] * 3, 30), _requested()
        removed = httpx.delete(f"{srv.http_url}/admin/workers/{worker_id}", headers=headers,
                               timeout=60)
        assert removed.status_code == 200, removed.text
        assert until(lambda: _requested() == [{"CPU": 0.5}] * 2, 30), _requested()
        assert until(lambda: _alive_nodes() == 1, 90), ray.nodes()  # idle: taken away
    finally:
        srv.stop()
        for worker in srv.router.workers.values():
            ray.kill(worker.client.actor)
