"""The CLI as users run it: real subprocesses, real Ray, real servers on port 0."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from pdserve.cli import main
from pdserve.client import Client


def test_offline_demo_reports_throughput(llama_dir, capsys):
    assert main(["demo", "--offline", "--model", str(llama_dir), "--num-prompts", "6",
                 "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "48 output tokens" in out and "tok/s" in out


def test_cluster_demo_goes_through_grpc_and_http(llama_dir):
    done = subprocess.run([sys.executable, "-m", "pdserve", "demo", "--model",
                           str(llama_dir), "--num-prompts", "4", "--max-tokens", "5"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 prefill + 1 decode worker" in done.stdout
    assert done.stdout.count("[gRPC]") == 4 and "[HTTP] /v1/completions 200" in done.stdout


def test_serve_drains_in_flight_requests_on_sigterm(llama_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "serve", "--model", str(llama_dir),
         "--grpc-port", "0", "--http-port", "0", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(32 << 20), "--drain-timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        target = None
        for line in process.stdout:
            match = re.search(r"gRPC (\S+)", line)
            if match:
                target = match.group(1)
                break
        assert target, "serve did not report its address"
        with Client(target) as client:
            stream = client.generate_stream([5, 6, 7], max_tokens=300, ignore_eos=True)
            first = next(stream)
            threading.Timer(0.05, process.send_signal, (signal.SIGTERM,)).start()
            rest = list(stream)  # the stream in flight completes during the drain
        chunks = [first] + rest
        assert sum(len(c.token_ids) for c in chunks) == 300
        assert chunks[-1].finish_reason == "length"
        assert process.wait(timeout=60) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_bench_compare_runs_both_modes_and_reports_the_ratio(llama_dir, tmp_path):
    import json
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "compare", "--model", str(llama_dir),
         "--workload", "azure-conv", "--scale", "0.02", "--num-prompts", "6", "--sweep", "20",
         "--slo-scale", "50", "--out-dir", str(tmp_path), "--name", "cmp"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "disaggregated / colocated:" in done.stdout
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert set(result["results"]) == {"disaggregated", "colocated"}
    assert result["results"]["colocated"]["workers"] == 2
    for mode in ("disaggregated", "colocated"):
        assert result["results"][mode]["rows"][0]["completed"] == 6
        assert (tmp_path / f"cmp-{mode}.png").exists()
    assert result["slo"]["ttft_ms"] == pytest.approx(50 * result["isolated_prefill_ms"])
