"""`pdserve bench` end to end against the real disaggregated cluster, both backends,
for a few seconds: every request completes and every output file is written."""
from __future__ import annotations

import json

import pytest

from pdserve.cli import main


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_against_the_cluster_writes_every_output(server, tmp_path, capsys, backend):
    target = server.grpc_target if backend == "grpc" else server.http_url
    args = ["bench", "run", "--backend", backend, "--target", target, "--workload", "azure-conv",
            "--scale", "0.05", "--num-prompts", "12", "--request-rate", "20",
            "--goodput", "ttft:5000", "tpot:1000", "--out-dir", str(tmp_path),
            "--name", backend, "--seed", "3"]
    if backend == "openai":
        args += ["--model", "test-llama", "--vocab-size", "2000"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s) [ttft:5000 tpot:1000]" in out
    result = json.loads((tmp_path / f"{backend}.json").read_text())
    assert result["completed"] == 12 and result["failed"] == 0 and result["rejected"] == 0
    assert result["ttft_ms"]["p50"] > 0 and result["output_throughput"] > 0
    assert 0 < result["slo_attainment"] <= 1
    assert (tmp_path / f"{backend}.md").read_text().startswith("| requests |")


def test_sweep_writes_rows_table_and_plot(server, tmp_path, capsys):
    assert main(["bench", "run", "--target", server.grpc_target, "--workload", "sharegpt-like",
                 "--scale", "0.1", "--num-prompts", "10", "--sweep", "4", "40",
                 "--goodput", "ttft:2000", "--num-workers", "2", "--out-dir", str(tmp_path),
                 "--name", "sweep"]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [row["rate"] for row in result["rows"]] == [4, 40]
    assert all(row["completed"] == 10 for row in result["rows"])
    if result["max_rate"] is not None:
        assert result["max_rate_per_worker"] == result["max_rate"] / 2
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rate req/s |" in (tmp_path / "sweep.md").read_text()
    assert "Highest rate per worker" in capsys.readouterr().out
