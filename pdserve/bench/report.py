"""Results as people read them: a text block in the shape of `vllm bench serve`'s,
JSON, a Markdown table, and for sweeps a PNG plot."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from pdserve.bench import require_extra

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
    row("Prompt tokens from prefix cache:", s["prefix_hit_share"], "{:<10.3f}")
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
    errors = s.get("prediction_error", {})
    if any(e["n"] for e in errors.values()):
        lines.append("{s:{c}^{n}}".format(s="Server forecast |error| / measured", n=_RULE,
                                          c="-"))
        for name, e in errors.items():
            row(f"Median {name.upper()} error:", e["p50"], "{:<10.3f}")
            row(f"P90 {name.upper()} error:", e["p90"], "{:<10.3f}")
    if "by_turn" in s:
        lines.append("{s:{c}^{n}}".format(s="Sessions by turn (TTFT ms, prefix hits)",
                                          n=_RULE, c="-"))
        row("Sessions:", s["sessions"]["sessions"])
        row("Sessions ended by a failed turn:", s["sessions"]["ended_by_failure"])
        lines += by_turn_table(s["by_turn"])
    lines.append("=" * _RULE)
    return "\n".join(lines)


def by_turn_table(turns: dict) -> list[str]:
    """A line per turn bucket: requests, TTFT p50 and p90, and the share of prompt
    tokens each prefix-cache tier served."""
    def ms(v):
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"{'turn':<5}{'requests':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'device':>8}"
             f"{'host':>7}"]
    for name, t in turns.items():
        share = t["prefix_hit_share"]
        lines.append(f"{name:<5}{t['requests']:>9}{ms(t['ttft_ms']['p50']):>10}"
                     f"{ms(t['ttft_ms']['p90']):>10}{share['device']:>8.3f}{share['host']:>7.3f}")
    return lines


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


def sweep_markdown(result: dict) -> str:
    rows = result["rows"]
    head = ("| rate req/s | attainment | goodput req/s | TTFT p50 ms | TTFT p99 ms | "
            "TPOT p50 ms | TPOT p99 ms | rejected |\n|---|---|---|---|---|---|---|---|\n")

    def cell(v):
        return "n/a" if v is None else f"{v:.2f}"

    body = "".join(
        f"| {cell(r['rate'])} | {cell(r['slo_attainment'])} | {cell(r['goodput'])} | "
        f"{cell(r['ttft_ms']['p50'])} | {cell(r['ttft_ms']['p99'])} | "
        f"{cell(r['tpot_ms']['p50'])} | {cell(r['tpot_ms']['p99'])} | {r['rejected']} |\n"
        for r in rows)
    best = result["max_rate_per_worker"]
    return head + body + (f"\nHighest rate per worker with >= {result['target_attainment']:.0%} "
                          f"attainment: {cell(best)} req/s\n")


def plot_sweep(result: dict, path: Path) -> None:
    matplotlib = require_extra("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(rates, [r["slo_attainment"] for r in rows], marker="o")
    axes[0].axhline(result["target_attainment"], linestyle="--", color="grey")
    if result["max_rate"] is not None:
        axes[0].axvline(result["max_rate"], linestyle=":", color="red")
    axes[0].set(title="SLO attainment", xlabel="request rate (req/s)", ylim=(0, 1.05))
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "tpot_ms", "TPOT (ms)")):
        for p in ("p50", "p90", "p99"):
            ax.plot(rates, [r[key][p] for r in rows], marker="o", label=p)
        ax.set(title=title, xlabel="request rate (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_sweep(out_dir: str | Path, name: str, result: dict, meta: dict) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    paths[0].write_text(json.dumps({**meta, **result}, indent=2))
    paths[1].write_text(sweep_markdown(result))
    plot_sweep(result, paths[2])
    return paths


def write(out_dir: str | Path, name: str, summary: dict, meta: dict) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({**meta, **summary}, indent=2))
    md_path.write_text(markdown(summary))
    return [json_path, md_path]


def spread(values: list) -> dict:
    """Repeats of one figure (seeds, rounds): the values, their median, min and max
    (None ones left out)."""
    vals = [v for v in values if v is not None]
    return {"values": values, "median": statistics.median(vals) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None}


def show(s: dict, digits: int = 2) -> str:
    """A spread as "median [min, max]"."""
    if s["median"] is None:
        return "n/a"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def save_json(path: str | Path, data: dict) -> Path:
    """A benchmark's results, its folder made if need be."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str))
    return out
