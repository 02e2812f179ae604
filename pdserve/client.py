"""The gRPC client SDK: `Client` (blocking) and `AsyncClient` (asyncio).

    client = Client("127.0.0.1:50051")
    out = client.generate("Hello", max_tokens=32, temperature=0)
    for chunk in client.generate_stream([1, 2, 3], max_tokens=8): ...
    several = client.generate("Hello", n=4, seed=7).choices  # one prefill, 4 choices

Sampling settings are SamplingParams' fields, as keyword arguments or as
`sampling_params=SamplingParams(...)`. SLOs are `slo_ttft_ms=` / `slo_tpot_ms=`: the
server places the request to meet them, or refuses it at once (OverloadedError with
its retry-after) when it cannot. Deadlines come from `timeout=` (per call, else
the client's default). Only RESOURCE_EXHAUSTED (overload) is retried, with exponential
backoff that honours the server's retry-after, and only before any token has arrived.
Failures raise typed exceptions: InvalidArgumentError, OverloadedError,
DeadlineExceededError, UnavailableError, all PdserveError. Imports neither torch nor Ray.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve import env
from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from pdserve.v1.sampling import to_proto

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}


class PdserveError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class InvalidArgumentError(PdserveError):
    pass


class OverloadedError(PdserveError):
    def __init__(self, code, message, retry_after_s: float | None):
        super().__init__(code, message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(PdserveError):
    pass


class UnavailableError(PdserveError):
    pass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    host_cached_prompt_tokens: int = 0  # of those, from a host-memory prefix tier


@dataclass
class CompletionChunk:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    usage: Usage | None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # {token: logprob}
    timings: Timings | None = None  # on the last chunk
    # prompt_logprobs asked for: on the first chunk, per prompt token (None for the
    # first) its PromptLogprob (logprob, rank, top {token: logprob}).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    index: int = 0  # n > 1: the choice these tokens are of (chunks of the n interleave)


@dataclass(frozen=True)
class PromptLogprob:
    logprob: float
    rank: int  # of the prompt token there (1: the most likely)
    top: dict[int, float]


@dataclass(frozen=True)
class Timings:
    """The server's measurements and its routing forecast (None: no forecast)."""
    ttft_s: float
    e2e_s: float
    predicted_ttft_s: float | None
    predicted_tpot_s: float | None


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # {token: logprob}
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    ttft_s: float | None = None  # measured by the client
    e2e_s: float | None = None
    timings: Timings | None = None  # the server's
    prompt_logprobs: list[PromptLogprob | None] | None = None  # asked for: per prompt token
    # n > 1: choices 1 .. n-1 (`choices` has them all); this one's usage is the
    # request's (the prompt once, every choice's tokens).
    others: list[Completion] = field(default_factory=list, repr=False, compare=False)

    @property
    def choices(self) -> list[Completion]:
        """Every choice's Completion in index order, this one (choice 0) first."""
        return [self, *self.others]

    def add(self, chunk: CompletionChunk, started: float) -> None:
        while len(self.others) < chunk.index:
            self.others.append(Completion())
        (self.others[chunk.index - 1] if chunk.index else self)._add(chunk, started)
        if chunk.usage is not None:
            self.usage = chunk.usage

    def _add(self, chunk: CompletionChunk, started: float) -> None:
        if self.ttft_s is None and chunk.token_ids:
            self.ttft_s = time.perf_counter() - started
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_logprobs += chunk.top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.e2e_s = time.perf_counter() - started
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timings is not None:
            self.timings = chunk.timings
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs


def _request(prompt, request_id: str, sampling_params: SamplingParams | None,
             sampling: dict) -> pb.GenerateRequest:
    slo = {k: v for k in ("slo_ttft_ms", "slo_tpot_ms")
           if (v := sampling.pop(k, None)) is not None}
    params = to_proto(sampling_params, **sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id, text=prompt, sampling_params=params,
                                  **slo)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(prompt)),
                              sampling_params=params, **slo)


def _chunk(r: pb.GenerateResponse) -> CompletionChunk:
    usage = (Usage(r.usage.prompt_tokens, r.usage.completion_tokens,
                   r.usage.cached_prompt_tokens, r.usage.host_cached_prompt_tokens)
             if r.HasField("usage") else None)
    tm = r.timings
    timings = (Timings(tm.ttft_seconds, tm.e2e_seconds, tm.predicted_ttft_seconds or None,
                       tm.predicted_tpot_seconds or None) if r.HasField("timings") else None)
    prompt = [PromptLogprob(p.logprob, p.rank, dict(zip(p.top.token_ids, p.top.logprobs)))
              if p.HasField("logprob") else None for p in r.prompt_logprobs]
    return CompletionChunk(r.request_id, list(r.token_ids), r.text, list(r.logprobs),
                           _FINISH.get(r.finish_reason), usage,
                           [dict(zip(t.token_ids, t.logprobs)) for t in r.top_logprobs],
                           timings, prompt or None, r.index)


def _error(err: grpc.RpcError) -> PdserveError:
    code, message = err.code(), err.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = None
        for key, value in (err.trailing_metadata() or ()):
            if key == "retry-after":
                retry_after = float(value)
        if retry_after is not None:  # the server's overload: worth a retry
            return OverloadedError(code, message, retry_after)
        return PdserveError(code, message)  # e.g. a message over the size limit
    kind = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
            grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
            grpc.StatusCode.UNAVAILABLE: UnavailableError}.get(code, PdserveError)
    return kind(code, message)


def _credentials(tls: bool, ca_file: str | None):
    if not tls and ca_file is None:
        return None
    roots = None if ca_file is None else Path(ca_file).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=roots)


class _Settings:
    def __init__(self, timeout: float | None, max_retries: int, backoff_s: float,
                 api_key: str | None):
        self.timeout, self.max_retries, self.backoff_s = timeout, max_retries, backoff_s
        key = api_key or env.api_key()
        # Without API keys, this client's requests are its session's: only it can
        # abort them (connections can be shared between channels of one process).
        self.metadata = (("pdserve-session", uuid.uuid4().hex),
                         *((("authorization", f"Bearer {key}"),) if key else ()))


def _retry_delay(err: grpc.RpcError, received: bool, attempt: int, s: _Settings) -> float:
    """Seconds to wait before retrying a failed Generate; raises the typed error when
    it must not be retried (only an overload before any token is, up to max_retries)."""
    error = _error(err)
    if received or not isinstance(error, OverloadedError) or attempt == s.max_retries:
        raise error from None
    return max(error.retry_after_s or 0.0, s.backoff_s * (2 ** attempt))


class Client:
    def __init__(self, target: str, timeout: float | None = 60.0, max_retries: int = 3,
                 backoff_s: float = 0.1, api_key: str | None = None, tls: bool = False,
                 ca_file: str | None = None):
        """api_key: sent as `authorization: Bearer` (default: $PDSERVE_API_KEY).
        tls (or a ca_file, PEM roots to verify the server with; default the system's)
        connects over TLS."""
        credentials = _credentials(tls, ca_file)
        self._channel = (grpc.insecure_channel(target) if credentials is None
                         else grpc.secure_channel(target, credentials))
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self._settings = _Settings(timeout, max_retries, backoff_s, api_key)

    def generate(self, prompt, *, timeout: float | None = None, request_id: str = "",
                 sampling_params: SamplingParams | None = None, **sampling) -> Completion:
        started = time.perf_counter()
        completion = Completion()
        for chunk in self.generate_stream(prompt, timeout=timeout, request_id=request_id,
                                          sampling_params=sampling_params, **sampling):
            completion.add(chunk, started)
        return completion

    def generate_stream(self, prompt, *, timeout: float | None = None, request_id: str = "",
                        sampling_params: SamplingParams | None = None, **sampling):
        request = _request(prompt, request_id, sampling_params, sampling)
        s = self._settings
        for attempt in range(s.max_retries + 1):
            received = False
            try:
                for response in self._stub.Generate(request, timeout=timeout or s.timeout,
                                                    metadata=s.metadata):
                    received = True
                    yield _chunk(response)
                return
            except grpc.RpcError as err:
                time.sleep(_retry_delay(err, received, attempt, s))

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        try:
            return self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                    timeout=timeout or self._settings.timeout,
                                    metadata=self._settings.metadata).found
        except grpc.RpcError as err:
            raise _error(err) from None

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        try:
            return self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                           timeout=timeout or self._settings.timeout,
                                           metadata=self._settings.metadata)
        except grpc.RpcError as err:
            raise _error(err) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    def __init__(self, target: str, timeout: float | None = 60.0, max_retries: int = 3,
                 backoff_s: float = 0.1, api_key: str | None = None, tls: bool = False,
                 ca_file: str | None = None):
        """As Client's."""
        credentials = _credentials(tls, ca_file)
        self._channel = (grpc.aio.insecure_channel(target) if credentials is None
                         else grpc.aio.secure_channel(target, credentials))
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self._settings = _Settings(timeout, max_retries, backoff_s, api_key)

    async def generate(self, prompt, *, timeout: float | None = None, request_id: str = "",
                       sampling_params: SamplingParams | None = None, **sampling) -> Completion:
        started = time.perf_counter()
        completion = Completion()
        async for chunk in self.generate_stream(prompt, timeout=timeout, request_id=request_id,
                                                sampling_params=sampling_params, **sampling):
            completion.add(chunk, started)
        return completion

    async def generate_stream(self, prompt, *, timeout: float | None = None,
                              request_id: str = "", sampling_params: SamplingParams | None = None,
                              **sampling):
        request = _request(prompt, request_id, sampling_params, sampling)
        s = self._settings
        for attempt in range(s.max_retries + 1):
            received = False
            call = self._stub.Generate(request, timeout=timeout or s.timeout,
                                       metadata=s.metadata)
            try:
                async for response in call:
                    received = True
                    yield _chunk(response)
                return
            except grpc.RpcError as err:
                await asyncio.sleep(_retry_delay(err, received, attempt, s))
            finally:
                call.cancel()  # no-op when complete; a consumer that stops early cancels

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        try:
            return (await self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                           timeout=timeout or self._settings.timeout,
                                           metadata=self._settings.metadata)).found
        except grpc.RpcError as err:
            raise _error(err) from None

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        try:
            return await self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                 timeout=timeout or self._settings.timeout,
                                                 metadata=self._settings.metadata)
        except grpc.RpcError as err:
            raise _error(err) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
