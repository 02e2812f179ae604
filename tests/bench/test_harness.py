"""The goodput harness's pure parts: metric math, SLO goodput, the sweep crossing,
arrival processes and workloads."""
from __future__ import annotations

import json
import statistics

import pytest

from pdserve.bench.arrivals import arrival_times, trace_times
from pdserve.bench.metrics import SLO, RequestRecord, crossing, summarize
from pdserve.bench.workloads import PROFILES, make_workload, seen_block_share


def record(send, token_times, end=None, prompt=10, **kw) -> RequestRecord:
    return RequestRecord(send, prompt, list(token_times),
                         end if end is not None else (token_times[-1] if token_times else None),
                         **kw)


def test_per_request_metrics_are_exact():
    r = record(1.0, [1.2, 1.25, 1.35, 1.40])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx((0.4 - 0.2) / 3)
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    chunked = record(0.0, [0.1, 0.3, 0.3, 0.3])  # three tokens arrived in one chunk
    assert chunked.itls == pytest.approx([0.2, 0.0, 0.0])
    assert record(0.0, [0.5]).tpot is None


def test_goodput_counts_only_requests_meeting_every_limit():
    records = [
        record(0.0, [0.1, 0.2, 0.3]),  # ttft 100, tpot 100
        record(0.0, [0.3, 0.35, 0.4]),  # ttft 300 -> misses ttft:200
        record(0.0, [0.1, 0.5, 0.9]),  # tpot 400 -> misses tpot:150
        record(0.0, [], end=None, error="boom"),  # failed: counted, never good
        record(0.0, [], end=None, rejected=True),  # rejected: counted, never good
    ]
    slo = SLO.parse(["ttft:200", "tpot:150"])
    s = summarize(records, duration_s=2.0, slo=slo, num_workers=2)
    assert (s["requests"], s["completed"], s["failed"], s["rejected"]) == (5, 3, 1, 1)
    assert s["goodput"] == pytest.approx(0.5)  # one good request in 2 s
    assert s["goodput_per_worker"] == pytest.approx(0.25)
    assert s["slo_attainment"] == pytest.approx(1 / 5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(500 / 3)
    assert s["output_throughput"] == pytest.approx(9 / 2)
    only_e2e = SLO.parse(["e2el:500"])
    assert summarize(records, 2.0, only_e2e)["slo_attainment"] == pytest.approx(2 / 5)


def test_bad_goodput_spec_is_refused():
    with pytest.raises(ValueError, match="ttft:MS"):
        SLO.parse(["latency:5"])


def test_crossing_interpolates_the_90_percent_point():
    assert crossing([1, 2, 3, 4], [1.0, 0.95, 0.85, 0.5]) == pytest.approx(2.5)
    assert crossing([1, 2], [0.99, 0.95]) == 2  # never crossed: the highest rate tried
    assert crossing([1, 2], [0.5, 0.4]) is None  # not even the lowest rate meets it
    assert crossing([3, 1, 2], [0.7, 1.0, 0.9]) == pytest.approx(2.0)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_asked_mean_and_coefficient_of_variation(burstiness):
    times = arrival_times(20_000, rate=50.0, burstiness=burstiness, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert arrival_times(3, rate=float("inf")) == [0.0, 0.0, 0.0]
    assert trace_times([5.0, 7.5, 6.0]) == [0.0, 2.5, 1.0]


def test_workloads_are_seeded_and_follow_their_profiles():
    a = make_workload("azure-conv", 400, vocab_size=1000, seed=3)
    b = make_workload("azure-conv", 400, vocab_size=1000, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    inp, out = PROFILES["azure-conv"]
    assert statistics.median(len(r.prompt) for r in a) == pytest.approx(inp.median, rel=0.15)
    assert statistics.median(r.max_tokens for r in a) == pytest.approx(out.median, rel=0.15)
    small = make_workload("azure-conv", 400, vocab_size=1000, seed=3, scale=0.1)
    assert max(len(r.prompt) for r in small) <= inp.maximum * 0.1
    rand = make_workload("random", 200, vocab_size=1000, input_len=100, output_len=20,
                         range_ratio=0.5)
    assert all(50 <= len(r.prompt) <= 150 and 10 <= r.max_tokens <= 30 for r in rand)
    shared = make_workload("prefix-shared", 200, vocab_size=1000, prefix_share=1.0,
                           prefix_len=32, input_len=8)
    assert len({tuple(r.prompt[:32]) for r in shared}) <= 4


def test_conversations_extend_their_last_prompt_and_reuse_about_37_percent():
    reqs = make_workload("conversations", 400, vocab_size=1000, seed=5, scale=0.25)
    # a later turn starts with an earlier turn's whole prompt, and that prompt's reply
    # (max_tokens of it) and a new message follow it
    extended = [(i, j) for i, a in enumerate(reqs) for j in range(i + 1, len(reqs))
                if reqs[j].prompt[:len(a.prompt)] == a.prompt]
    assert len(extended) > 100
    i, j = extended[0]
    assert len(reqs[j].prompt) > len(reqs[i].prompt) + reqs[i].max_tokens
    assert 0.30 <= seen_block_share(reqs, 16) <= 0.45
    assert seen_block_share(make_workload("azure-conv", 100, 1000), 16) == 0.0
    assert seen_block_share([reqs[0], reqs[0]], 16) == pytest.approx(0.5)


def test_jsonl_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "hello", "max_tokens": 4, "timestamp": 0.5},
        {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}]))
    reqs = make_workload("file", 0, vocab_size=10, path=str(path))
    assert [(r.prompt, r.max_tokens, r.timestamp) for r in reqs] == [
        ("hello", 4, 0.5), ([1, 2, 3], 2, None)]
    path.write_text(json.dumps({"prompt": "no max_tokens"}))
    with pytest.raises(ValueError, match=":1: needs"):
        make_workload("file", 0, vocab_size=10, path=str(path))


def test_openai_ttft_waits_for_the_first_visible_text():
    from pdserve.bench.driver import _take_sse_chunk
    record, reply = RequestRecord(10.0), []
    _take_sse_chunk(record, {"choices": [{"text": "", "token_ids": [5]}]}, 10.1, reply)
    _take_sse_chunk(record, {"choices": [{"text": "Hi", "token_ids": [6]}]}, 10.3, reply)
    assert record.num_output_tokens == 2 and reply == [5, 6]
    silent = []  # a server that sends no token ids: a session puts filler in their place
    _take_sse_chunk(RequestRecord(10.0), {"choices": [{"text": "Hi"}]}, 10.1, silent)
    assert silent == []
    assert record.ttft == pytest.approx(0.3)  # not 0.1: nothing was readable then
    _take_sse_chunk(record, {"choices": [], "usage": {
        "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}, 10.4)
    assert (record.num_prompt_tokens, record.num_cached_tokens) == (40, 32)
    _take_sse_chunk(record, {"choices": [], "usage": {"prompt_tokens": 40,
                                                      "prompt_tokens_details": None}}, 10.5)
    assert record.num_cached_tokens == 0  # a server that does not say
