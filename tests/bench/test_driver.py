"""The harness driver against a deterministic gRPC test server with scripted delays:
what it measures matches the script, rejections are counted, goodput follows."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.bench.driver import RunConfig, run
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.workloads import BenchRequest
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

GAP_S = 0.02
SLACK_S = 0.2
REJECT = 999


class Scripted(pb_grpc.GenerateServiceServicer):
    """TTFT = first prompt token in ms; then one token every GAP_S."""

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        if ids[0] == REJECT:  # as pdserve refuses: with a retry-after
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        await asyncio.sleep(ids[0] / 1000)
        n = request.sampling_params.max_tokens
        for i in range(n):
            if i:
                await asyncio.sleep(GAP_S)
            last = i == n - 1
            yield pb.GenerateResponse(
                request_id="r", token_ids=[7], text="x",
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=n,
                               cached_prompt_tokens=len(ids) - 1) if last else None)


async def bench(requests, slo):
    server = grpc.aio.server()
    pb_grpc.add_GenerateServiceServicer_to_server(Scripted(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        records, duration = await run(requests, RunConfig("grpc", f"127.0.0.1:{port}",
                                                          progress=False))
    finally:
        await server.stop(0)
    return records, summarize(records, duration, slo)


def test_driver_measures_the_scripted_latencies():
    requests = [BenchRequest([50, 1, 2], 6), BenchRequest([200, 1], 6),
                BenchRequest([50, 3], 1), BenchRequest([REJECT, 1], 4)]
    records, s = asyncio.run(bench(requests, SLO.parse(["ttft:120", "tpot:60"])))
    fast, slow, single, rejected = records
    # Scripted delays are lower bounds; the slack above them (event loop, gRPC, a
    # busy 2-core machine) is generous on purpose: the ordering is what must hold.
    assert 0.050 <= fast.ttft < 0.050 + SLACK_S
    assert 0.200 <= slow.ttft < 0.200 + SLACK_S and slow.ttft > fast.ttft
    assert GAP_S * 0.9 <= fast.tpot < GAP_S + SLACK_S / 4
    assert fast.num_output_tokens == 6 and fast.num_prompt_tokens == 3
    assert fast.num_cached_tokens == 2
    # 7 prompt tokens completed (3 + 2 + 2), 4 of them cached (2 + 1 + 1)
    assert s["prefix_hit_share"] == pytest.approx(4 / 7)
    assert single.tpot is None and single.num_output_tokens == 1
    assert rejected.rejected and not rejected.ok
    assert (s["completed"], s["rejected"], s["failed"]) == (3, 1, 0)
    # fast and single meet ttft:120; slow does not; the rejection never counts.
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    assert s["goodput"] == pytest.approx(2 / s["duration_s"])


def test_max_concurrency_serializes_requests():
    requests = [BenchRequest([40, 1], 2) for _ in range(4)]
    server_side = asyncio.run(bench(requests, SLO()))
    records = server_side[0]
    starts = sorted(r.send_time for r in records)
    # Uncapped, all go out before the first one ends (each takes 40 + 20 ms; capped,
    # the starts would be at least that far apart).
    assert starts[-1] - starts[0] < 0.060

    async def capped():
        server = grpc.aio.server()
        pb_grpc.add_GenerateServiceServicer_to_server(Scripted(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run(requests, RunConfig("grpc", f"127.0.0.1:{port}",
                                                 max_concurrency=1, progress=False))
        finally:
            await server.stop(0)

    records, duration = asyncio.run(capped())
    assert duration >= 4 * 0.06  # one at a time: each takes 40 ms + 20 ms


class Echo(pb_grpc.GenerateServiceServicer):
    """At once: a reply that is a function of the prompt, its cached tokens the longest
    earlier prompt-and-reply the prompt starts with."""

    def __init__(self):
        self.seen: list[list[int]] = []

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        n = request.sampling_params.max_tokens
        reply = [4 + (len(ids) + i) % 40 for i in range(n)]
        cached = max((len(s) for s in self.seen if ids[:len(s)] == s), default=0)
        self.seen.append(ids + reply)
        for i, token in enumerate(reply):
            last = i == n - 1
            yield pb.GenerateResponse(
                request_id="r", token_ids=[token], text="x",
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=n,
                               cached_prompt_tokens=cached) if last else None)


def test_a_session_s_turns_go_out_in_order_each_with_the_reply_the_server_sent():
    from pdserve.bench.sessions import SessionShape
    from pdserve.bench.workloads import make_workload

    sessions = make_workload("sessions", 5, vocab_size=50, seed=2, scale=0.02,
                             sessions=SessionShape(mean_turns=4, think_s=0.0,
                                                   max_model_len=400))
    echo = Echo()

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_GenerateServiceServicer_to_server(echo, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run(sessions, RunConfig("grpc", f"127.0.0.1:{port}", max_concurrency=2,
                                                 progress=False))
        finally:
            await server.stop(0)
    records, duration = asyncio.run(go())
    assert all(r.ok for r in records) and len(records) > 5
    for number in range(5):
        turns = [r for r in records if r.session == number]
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        assert all(b.send_time >= a.end_time for a, b in zip(turns, turns[1:]))
        # each later prompt began with the last prompt and the reply it got: all cached
        assert turns[0].num_cached_tokens == 0
        assert all(b.num_cached_tokens == a.num_prompt_tokens + a.num_output_tokens
                   for a, b in zip(turns, turns[1:]))
    s = summarize(records, duration, SLO())
    assert s["sessions"] == {"sessions": 5, "turns": len(records), "ended_by_failure": 0}


def test_bench_run_takes_the_sessions_workload_and_its_flags():
    from pdserve.bench.cli import workload_of
    from pdserve.bench.sessions import Session
    from pdserve.cli import build_parser

    args = build_parser().parse_args([
        "bench", "run", "--target", "127.0.0.1:1", "--workload", "sessions",
        "--session-turns", "3", "--think-time", "0.25", "--max-model-len", "512",
        "--scale", "0.05", "--num-prompts", "4"])
    sessions = workload_of(args, 1000, max_model_len=args.max_model_len)(0)
    assert len(sessions) == 4 and all(isinstance(s, Session) for s in sessions)
    first = sessions[0].first_turn()
    assert len(first.prompt) + first.max_tokens <= 512 and (first.session, first.turn) == (0, 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "compare", "--sweep", "1", "--workload", "sessions"])
