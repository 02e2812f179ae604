"""Results as people read them: a text block in the shape of `vllm bench serve`'s,
plus JSON and a Markdown table."""
from __future__ import annotations

import json
from pathlib import Path

_RULE = 50


def text_block(s: dict, slo_text: str = "") -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_RULE, c="=")]

    def row(label: str, value, fmt: str = "{:<10}") -> None:
        shown = "n/a" if value is None else (fmt.format(value) if not isinstance(value, str)
                                             else value)
        lines.append(f"{label:<40} {shown}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Rejected requests (overload):", s["rejected"])
    row("Benchmark duration (s):", s["duration_s"], "{:<10.2f}")
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    row(f"Request goodput (req/s){slo_text}:", s["goodput"], "{:<10.2f}")
    row("SLO attainment:", s["slo_attainment"], "{:<10.3f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Input token throughput (tok/s):", s["input_throughput"], "{:<10.2f}")
    for key, title, name in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"),
                             ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=_RULE, c="-"))
        stats = s[key]
        row(f"Mean {name} (ms):", stats["mean"], "{:<10.2f}")
        row(f"Median {name} (ms):", stats["p50"], "{:<10.2f}")
        row(f"P90 {name} (ms):", stats["p90"], "{:<10.2f}")
        row(f"P99 {name} (ms):", stats["p99"], "{:<10.2f}")
    lines.append("=" * _RULE)
    return "\n".join(lines)


def markdown(s: dict) -> str:
    def cell(v):
        return "n/a" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    head = ("| requests | ok | failed | rejected | req/s | goodput req/s | attainment | "
            "out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    values = [s["requests"], s["completed"], s["failed"], s["rejected"],
              s["request_throughput"], s["goodput"], s["slo_attainment"],
              s["output_throughput"], s["ttft_ms"]["p50"], s["ttft_ms"]["p99"],
              s["tpot_ms"]["p50"], s["tpot_ms"]["p99"]]
    return head + "| " + " | ".join(cell(v) for v in values) + " |\n"


def write(out_dir: str | Path, name: str, summary: dict, meta: dict) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({**meta, **summary}, indent=2))
    md_path.write_text(markdown(summary))
    return [json_path, md_path]
