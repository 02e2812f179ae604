from pdserve.cli import main


def test_demo_runs_the_offline_engine_and_reports_throughput(llama_dir, capsys):
    assert main(["demo", "--model", str(llama_dir), "--num-prompts", "6",
                 "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "48 output tokens" in out and "tok/s" in out
