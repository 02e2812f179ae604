"""Drives a server with a workload and records every request's token arrival times.

Backends: pdserve's gRPC API (the SDK's AsyncClient, retries off so overload counts
as a rejection) or any OpenAI-compatible HTTP server (/v1/completions, streaming).
Requests go out at their arrival times, optionally capped at --max-concurrency.
Sessions (sessions.py) start at their arrival times and send each turn once the one
before has ended and its think time has passed; --max-concurrency then caps the
sessions under way (users), not their requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from dataclasses import dataclass

from pdserve.bench import require_extra
from pdserve.bench.arrivals import arrival_times, trace_times
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.sessions import Session, play
from pdserve.bench.workloads import BenchRequest
from pdserve.progress import bar as progress_bar

BACKENDS = ("grpc", "openai")


@dataclass(frozen=True)
class RunConfig:
    backend: str  # "grpc" | "openai"
    target: str  # host:port for grpc, base URL (http://host:port) for openai
    model: str | None = None  # the model name an OpenAI server expects
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int = 0  # 0 = no cap
    seed: int = 0
    timeout_s: float = 600.0  # per request
    progress: bool = True  # a bar of requests ended, on a terminal
    api_key: str | None = None  # sent as Authorization: Bearer
    ca_file: str | None = None  # TLS: PEM roots that verify the server (gRPC; https)
    # SLOs sent with every request (gRPC fields; x-slo-*-ms headers over HTTP), so a
    # goodput-aware server places by the SLOs the run is measured against.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.max_concurrency < 0:
            raise ValueError("max_concurrency must be >= 0")


async def run(requests: list[BenchRequest | Session],
              cfg: RunConfig) -> tuple[list[RequestRecord], float]:
    """Sends every request and plays every session; returns their records (a
    session's turns in order) and the wall time of the run."""
    if requests and all(isinstance(r, BenchRequest) and r.timestamp is not None
                        for r in requests):
        offsets = trace_times([r.timestamp for r in requests])
    else:
        offsets = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = progress_bar(len(requests), "bench", "req", quiet=not cfg.progress)
    async with _backend(cfg) as send:
        start = time.perf_counter()

        async def one(item: BenchRequest | Session, offset: float) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            records: list[RequestRecord] = []

            async def sent(req: BenchRequest, reply: list[int] | None = None) -> RequestRecord:
                records.append(await send(req, reply))
                return records[-1]
            async with cap if cap is not None else contextlib.nullcontext():
                await (play(item, sent) if isinstance(item, Session) else sent(item))
            bar.update(1)
            return records

        ended = await asyncio.gather(*[one(r, o) for r, o in zip(requests, offsets)])
        duration = time.perf_counter() - start
    bar.close()
    return [record for records in ended for record in records], duration


class _backend:
    """An async context giving `send(request, reply=None) -> RequestRecord` for the
    backend (reply: a list the output token ids go to)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    async def __aenter__(self):
        if self.cfg.backend == "grpc":
            from pdserve.client import AsyncClient
            self._client = AsyncClient(self.cfg.target, timeout=self.cfg.timeout_s,
                                       max_retries=0, api_key=self.cfg.api_key,
                                       ca_file=self.cfg.ca_file)
            return self._send_grpc
        httpx = require_extra("httpx")
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        verify = True if self.cfg.ca_file is None else ssl.create_default_context(
            cafile=self.cfg.ca_file)
        self._client = httpx.AsyncClient(base_url=self.cfg.target, timeout=self.cfg.timeout_s,
                                         limits=httpx.Limits(max_connections=None),
                                         headers=headers, verify=verify)
        return self._send_openai

    async def __aexit__(self, *exc):
        if self.cfg.backend == "grpc":
            await self._client.close()
        else:
            await self._client.aclose()

    async def _send_grpc(self, req: BenchRequest,
                         reply: list[int] | None = None) -> RequestRecord:
        """reply (given): the output token ids are put there."""
        from pdserve.client import OverloadedError
        record = RequestRecord(time.perf_counter(), session=req.session, turn=req.turn)
        try:
            async for chunk in self._client.generate_stream(
                    req.prompt, max_tokens=req.max_tokens, temperature=0, ignore_eos=True,
                    slo_ttft_ms=self.cfg.slo_ttft_ms, slo_tpot_ms=self.cfg.slo_tpot_ms):
                now = time.perf_counter()
                record.token_times += [now] * len(chunk.token_ids)
                if reply is not None:
                    reply += chunk.token_ids
                if chunk.token_ids and record.first_output_time is None:
                    record.first_output_time = now
                if chunk.usage is not None:
                    record.num_prompt_tokens = chunk.usage.prompt_tokens
                    record.num_cached_tokens = chunk.usage.cached_prompt_tokens
                    record.num_host_cached_tokens = chunk.usage.host_cached_prompt_tokens
                if chunk.timings is not None:
                    record.predicted_ttft = chunk.timings.predicted_ttft_s
                    record.predicted_tpot = chunk.timings.predicted_tpot_s
            record.end_time = time.perf_counter()
        except OverloadedError:
            record.rejected = True
            record.end_time = time.perf_counter()
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    async def _send_openai(self, req: BenchRequest,
                           reply: list[int] | None = None) -> RequestRecord:
        """reply (given): the output token ids are put there, where the server sends
        them (`return_token_ids`)."""
        body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        if self.cfg.model:
            body["model"] = self.cfg.model
        headers = {name: f"{value:g}" for name, value in (
            ("x-slo-ttft-ms", self.cfg.slo_ttft_ms), ("x-slo-tpot-ms", self.cfg.slo_tpot_ms))
            if value is not None}
        record = RequestRecord(time.perf_counter(), session=req.session, turn=req.turn)
        try:
            async with self._client.stream("POST", "/v1/completions", json=body,
                                           headers=headers) as response:
                if response.status_code == 429:
                    record.rejected = True
                    record.end_time = time.perf_counter()
                    return record
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:200]}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    _take_sse_chunk(record, json.loads(line[6:]), time.perf_counter(), reply)
            record.end_time = time.perf_counter()
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record


def _take_sse_chunk(record: RequestRecord, chunk: dict, now: float,
                    reply: list[int] | None = None) -> None:
    if chunk.get("usage"):
        record.num_prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
        details = chunk["usage"].get("prompt_tokens_details") or {}
        record.num_cached_tokens = details.get("cached_tokens") or 0
    for choice in chunk.get("choices", []):
        # Servers without token ids in chunks: one non-empty text chunk ~ one token.
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
        if reply is not None and ids is not None:
            reply += ids
        record.token_times += [now] * n
        if choice.get("text") and record.first_output_time is None:
            record.first_output_time = now
