"""Per-request latency metrics, SLO goodput and the sweep's crossing point.

TTFT = first visible output - send (RequestRecord.first_output_time);
TPOT = (e2e - TTFT) / (output tokens - 1); every gap
between consecutive tokens is an inter-token latency (a chunk of k tokens counts as k
tokens arriving together). A request counts toward goodput only if it finished and
met every limit given; failures and rejections are counted, never dropped.

A sessions run (sessions.py) is also reported by turn number: TTFT and the prefix
caches' hits by tier, for turns 1, 2, 3 and 4 on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
TURNS = ("1", "2", "3", "4+")  # the by-turn report's buckets


@dataclass
class RequestRecord:
    send_time: float
    num_prompt_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    end_time: float | None = None
    error: str | None = None
    rejected: bool = False  # overload (429 / RESOURCE_EXHAUSTED)
    # When the first output reached the client: the first chunk carrying a token
    # (gRPC), or the first with non-empty text (OpenAI: what a user can see).
    first_output_time: float | None = None
    # The server's forecast when it placed the request (pdserve gRPC), in seconds.
    predicted_ttft: float | None = None
    predicted_tpot: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the server's prefix cache
    num_host_cached_tokens: int = 0  # of those, the ones its host-memory tier held
    session: int | None = None  # sessions workload: the request's session
    turn: int | None = None  # and its turn number there, from 1

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected and self.end_time is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        first = self.first_output_time
        if first is None and self.token_times:
            first = self.token_times[0]
        return None if first is None else first - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, specs: list[str]) -> "SLO":
        """['ttft:200', 'tpot:50', 'e2el:5000'] (milliseconds), as vllm bench serve."""
        limits = {}
        for spec in specs:
            name, _, value = spec.partition(":")
            if name not in ("ttft", "tpot", "e2el") or not value:
                raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {spec!r}")
            limits[f"{name}_ms"] = float(value)
        return cls(**limits)

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = [(self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2el_ms, r.e2e)]
        # A one-token request has no TPOT: nothing to violate.
        return all(limit is None or value is None or value * 1e3 <= limit
                   for limit, value in checks)


def _stats(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()),
            **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO,
              num_workers: int = 1, itl_ms: dict | None = None) -> dict:
    """itl_ms: the inter-token latency statistics where they were counted elsewhere
    (the simulator's workers); else from each record's token times."""
    done = [r for r in records if r.ok]
    good = sum(slo.met(r) for r in records)
    summary = {
        "requests": len(records), "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None),
        "rejected": sum(1 for r in records if r.rejected),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": sum(r.num_output_tokens for r in done) / duration_s,
        "input_throughput": sum(r.num_prompt_tokens for r in done) / duration_s,
        # The share of completed requests' prompt tokens the prefix caches served.
        "prefix_hit_share": (sum(r.num_cached_tokens for r in done)
                             / max(1, sum(r.num_prompt_tokens for r in done))),
        "ttft_ms": _stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": itl_ms or _stats([gap for r in done for gap in r.itls]),
        "e2el_ms": _stats([r.e2e for r in done]),
        "rejection_ms": _stats([r.e2e for r in records if r.rejected and r.e2e is not None]),
        "goodput": good / duration_s,
        "goodput_per_worker": good / duration_s / num_workers,
        "slo_attainment": good / len(records) if records else None,
        "prediction_error": {
            "ttft": _relative_error([(r.predicted_ttft, r.ttft) for r in done]),
            "tpot": _relative_error([(r.predicted_tpot, r.tpot) for r in done])},
    }
    if any(r.turn is not None for r in records):
        summary.update(sessions=session_counts(records), by_turn=by_turn(records))
    return summary


def session_counts(records: list[RequestRecord]) -> dict:
    """Sessions, their turns sent, and those that ended at a turn that did not
    complete (failed or refused) rather than as drawn."""
    last: dict[int, RequestRecord] = {}
    for r in records:
        if r.session is not None and (r.session not in last or r.turn > last[r.session].turn):
            last[r.session] = r
    return {"sessions": len(last), "turns": sum(r.turn is not None for r in records),
            "ended_by_failure": sum(not r.ok for r in last.values())}


def by_turn(records: list[RequestRecord]) -> dict:
    """Turn number (TURNS: 4 and later together) -> its requests, TTFT of those
    completed, and their prompt tokens the prefix caches served, by tier."""
    buckets: dict[str, list[RequestRecord]] = {name: [] for name in TURNS}
    for r in records:
        if r.turn is not None:
            buckets[TURNS[min(r.turn, len(TURNS)) - 1]].append(r)
    return {name: _turn_figures(rs) for name, rs in buckets.items()}


def _turn_figures(records: list[RequestRecord]) -> dict:
    done = [r for r in records if r.ok]
    prompt = sum(r.num_prompt_tokens for r in done)
    cached = {tier: sum(cached_by_tier(r)[tier] for r in done) for tier in ("device", "host")}
    return {"requests": len(records), "completed": len(done),
            "ttft_ms": _stats([r.ttft for r in done if r.ttft is not None]),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "prefix_hit_share": {tier: n / max(1, prompt) for tier, n in cached.items()}}


def cached_by_tier(r: RequestRecord) -> dict[str, int]:
    """The request's prefix-cache hits by tier: num_cached_tokens counts them all,
    num_host_cached_tokens those from host memory (0 where a server does not say:
    every hit counts as the device's)."""
    return {"device": r.num_cached_tokens - r.num_host_cached_tokens,
            "host": r.num_host_cached_tokens}


def _relative_error(pairs: list[tuple[float | None, float | None]]) -> dict:
    """|predicted - measured| / measured over the requests the server forecast."""
    errors = [abs(p - m) / m for p, m in pairs if p is not None and m]
    if not errors:
        return {"n": 0, "p50": None, "p90": None}
    return {"n": len(errors), "p50": float(np.percentile(errors, 50)),
            "p90": float(np.percentile(errors, 90))}


def crossing(rates: list[float], attainments: list[float], target: float = 0.9) -> float | None:
    """The highest rate with attainment >= target: the last measured rate that meets it,
    interpolated linearly toward the first one after it that does not."""
    points = sorted(zip(rates, attainments))
    best = None
    for (r0, a0), (r1, a1) in zip(points, points[1:] + [(None, None)]):
        if a0 < target:
            break
        best = r0
        if r1 is not None and a1 < target:
            best = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
            break
    return best
