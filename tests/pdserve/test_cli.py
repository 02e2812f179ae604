"""The CLI as users run it: real subprocesses, real Ray, real servers on port 0."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve.cli import main
from pdserve.client import Client, UnavailableError
from tests.front_process import FrontProcess


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


def test_sigterm_stops_both_front_ends_at_once_and_drains_what_is_in_flight(llama_dir):
    """On SIGTERM no new request of either API is admitted, an admin operation under
    way is answered 503 (it must not hold the drain), the streams in flight (gRPC and
    HTTP SSE) complete, and the process exits well within --drain-timeout with no
    traceback."""
    drain_timeout = 30
    process = FrontProcess(
        "serve", "--model", str(llama_dir), "--grpc-port", "0", "--http-port", "0",
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20),
        "--drain-timeout", str(drain_timeout), "--admin-api-key", "admin-key")
    lines = iter(process.stdout)
    admin_headers = {"Authorization": "Bearer admin-key"}
    with process:
        target, url = process.serving()
        workers = httpx.get(f"{url}/admin/workers", headers=admin_headers).json()["workers"]
        decode = next(w["worker_id"] for w in workers if w["role"] == "decode")
        sse: list[str] = []
        sse_began = threading.Event()

        def stream_over_http() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "prompt": [8, 9, 10], "max_tokens": 150, "ignore_eos": True,
                    "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        sse.append(line[len("data: "):])
                        sse_began.set()
        over_http = threading.Thread(target=stream_over_http)
        over_http.start()
        with Client(target) as client:
            stream = client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True)
            first = next(stream)
            assert sse_began.wait(60)
            # An admin operation under way: the drain waits for the stream to end.
            drained: list[httpx.Response] = []
            drain = threading.Thread(target=lambda: drained.append(httpx.post(
                f"{url}/admin/workers/{decode}/drain", headers=admin_headers, timeout=60)))
            drain.start()
            while not any(w["state"] == "draining" for w in httpx.get(
                    f"{url}/admin/workers", headers=admin_headers).json()["workers"]):
                assert drain.is_alive(), drained
            signaled = time.monotonic()
            process.process.send_signal(signal.SIGTERM)
            assert next(line for line in lines if "draining" in line)
            drain.join(10)
            assert [r.status_code for r in drained] == [503]
            assert "shutting down" in drained[0].json()["error"]["message"]
            with pytest.raises(UnavailableError), Client(target, max_retries=0) as late:
                late.generate([1, 2], max_tokens=2)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health")
            rest = list(stream)  # the streams in flight complete during the drain
        over_http.join(60)
        chunks = [first] + rest
        assert sum(len(c.token_ids) for c in chunks) == 200
        assert chunks[-1].finish_reason == "length"
        # an error event is an object with "error" (a completion may say "error" too)
        errors = [e for e in sse[:-1] if "error" in json.loads(e)]
        assert sse[-1] == "[DONE]" and not errors, errors
        assert json.loads(sse[-2])["choices"][0]["finish_reason"] == "length"
        assert process.exit_code(timeout_s=drain_timeout + 15) == 0
        assert time.monotonic() - signaled < drain_timeout
        assert any("stopped" in line for line in lines)
    assert not process.tracebacks(), process.tracebacks()


def test_bench_compare_runs_both_modes_and_reports_the_ratio(llama_dir, tmp_path):
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
