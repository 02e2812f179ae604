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
