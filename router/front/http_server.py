"""The OpenAI-compatible HTTP front end (FastAPI): /v1/completions,
/v1/chat/completions (when the tokenizer has a chat template), /v1/models, /health,
/ready, /live, /metrics. Errors are OpenAI-shaped JSON: bad input 400 naming the field,
overload 429 with Retry-After, a failed worker 503."""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdserve.engine.errors import InvalidRequestError, ModelNotFoundError, RequestFailedError
from pdserve.router.errors import OverloadedError, WorkerError
from pdserve.router.front import openapi
from pdserve.router.front.admin_http import admin_routes
from pdserve.router.front.auth import ApiKeys, owner
from pdserve.router.front.body_parser import BodyParser, InvalidBody, validation_message
from pdserve.router.front.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_messages,
    template_tools,
)
from pdserve.router.front.tool_calls import parse_tool_calls, stream_parser
from pdserve.router.router import Accepted, Router
from pdserve.worker.messages import TokenDelta


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error", headers: dict | None = None,
           code: str | int | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param, kind, code),
                        status_code=status, headers=headers)


def _error_body(status: int, message: str, param: str | None = None,
                kind: str = "invalid_request_error", code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code}}


# Failures after a request was accepted: (status, OpenAI error type). Before the first
# byte they are the response's status; mid-stream, an SSE error event then [DONE].
_FAILURES = {WorkerError: (503, "service_unavailable"),
             RequestFailedError: (500, "server_error")}


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 before anything parses it
    (by its Content-Length, or as the chunks arrive)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge(self.limit)
            return message
        await self.app(scope, counted, send)

    async def _too_large(self, scope, receive, send):
        await _error(413, _TooLarge.detail_for(self.limit))(scope, receive, send)


class _TooLarge(HTTPException):
    """Raised while the body is read, so the app's HTTPException handler answers."""

    def __init__(self, limit: int):
        super().__init__(413, self.detail_for(limit))

    @staticmethod
    def detail_for(limit: int) -> str:
        return f"the request body exceeds {limit} bytes"


def create_app(router: Router, keys: ApiKeys = ApiKeys(),
               admin_keys: ApiKeys = ApiKeys()) -> FastAPI:
    """/health, /ready and /live stay open to probes; /v1/* and /metrics need a key when
    keys are set; /admin exists only with admin keys, and needs one."""
    app = FastAPI(title="pdserve", version=_version(),
                  description="OpenAI-compatible completions served by pdserve.")
    app.add_middleware(_BodyLimit, limit=router.config.max_request_bytes)
    app.state.body_parser = parser = BodyParser(router.limits)
    openapi.install(app, bodies=(CompletionRequest, ChatRequest, TokenizeRequest,
                                 DetokenizeRequest), model=router.model.name,
                    vocab_size=router.model.vocab_size,
                    max_model_len=router.model.max_model_len,
                    max_prompt_chars=router.limits.max_prompt_chars, requires_key=keys.enabled)

    def caller(request: Request) -> str:
        key = keys.check(request.headers.get("authorization"))
        if key is None:
            raise HTTPException(401, "a valid API key is required "
                                "(Authorization: Bearer <key>)",
                                headers={"WWW-Authenticate": "Bearer"})
        return owner(key, request.headers.get("pdserve-session"), f"{request.client}")

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):  # 401, unknown routes and methods, 413
        code = "invalid_api_key" if exc.status_code == 401 else None
        return _error(exc.status_code, str(exc.detail), headers=exc.headers, code=code)

    model = router.model

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc: RequestValidationError):
        return _error(400, *validation_message(exc.errors()))

    @app.exception_handler(InvalidBody)
    async def _bad_body(request, exc: InvalidBody):
        return _error(400, exc.message, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request, exc: InvalidRequestError):
        if isinstance(exc, ModelNotFoundError):
            return _error(404, str(exc), exc.field, code="model_not_found")
        return _error(400, str(exc), exc.field)

    @app.exception_handler(OverloadedError)
    async def _overloaded(request, exc: OverloadedError):
        return _error(429, str(exc), kind="rate_limit_error",
                      headers={"Retry-After": f"{max(1, round(exc.retry_after_s))}"})

    @app.exception_handler(WorkerError)
    @app.exception_handler(RequestFailedError)
    async def _failed(request, exc: WorkerError | RequestFailedError):
        status, kind = _FAILURES[_failure_type(exc)]
        return _error(status, str(exc), kind=kind)

    if admin_keys.enabled:
        app.include_router(admin_routes(router, admin_keys))

    @app.get("/health", responses={503: {"description": "A worker is out of service"}})
    async def health():
        """200 while every worker is in service (or draining on purpose); 503 while one
        is out (stalled, restarting after its process died, or given up), with each
        worker's state."""
        workers = router.worker_states()
        if any(state not in ("serving", "draining") for state in workers.values()):
            return JSONResponse({"status": "degraded", "workers": workers}, status_code=503)
        return {"status": "ok", "workers": workers}

    @app.get("/ready", responses=openapi.errors(503))
    async def ready():
        if not router.ready:
            return _error(503, "a worker pool has no live worker", kind="service_unavailable")
        return {"status": "ready"}

    @app.get("/live")
    async def live():
        """200 while the router answers: a liveness probe's check. Unlike /health it
        does not look at the workers, so a worker being restarted or replaced never
        restarts the router (and, on KubeRay, the Ray head with it)."""
        return {"status": "alive"}

    @app.get("/metrics", dependencies=[Depends(caller)], responses={
        200: {"description": "Prometheus text format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **openapi.errors(401)})
    async def metrics():
        await router.refresh_stats()
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(caller)], responses=openapi.errors(401))
    async def models():
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions", responses=openapi.GENERATE,
              openapi_extra=openapi.request_body(CompletionRequest))
    async def completions(request: Request, who: str = Depends(caller)):
        body = await _body(parser, CompletionRequest, request)
        _check_model(body.model, model.name)
        accepted = await router.accept(body.prompt_input(), body.sampling_params(), owner=who,
                                       slo=body.slo(request.headers),
                                       constraint_field=body.constraint()[1])
        shape = _CompletionShape(accepted, model.name, body, router)
        return await _respond(router, accepted, shape, body, request)

    @app.post("/v1/chat/completions", responses=openapi.GENERATE,
              openapi_extra=openapi.request_body(ChatRequest))
    async def chat(request: Request, who: str = Depends(caller)):
        body = await _body(parser, ChatRequest, request)
        _check_model(body.model, model.name)
        if not router.tokenizer.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template")
        params = body.sampling_params()
        accepted = await router.accept_chat(body.template_messages(), params, owner=who,
                                            slo=body.slo(request.headers),
                                            constraint_field=body.constraint()[1],
                                            tools=body.template_tools())
        shape = _ChatShape(accepted, model.name, body, router)
        return await _respond(router, accepted, shape, body, request)

    @app.post("/tokenize", responses=openapi.errors(400, 401, 404, 413, 415),
              openapi_extra=openapi.request_body(TokenizeRequest))
    async def tokenize(request: Request, who: str = Depends(caller)):
        body = await _body(parser, TokenizeRequest, request)
        _check_model(body.model, model.name)
        ids = await router.intake.tokenize(
            body.prompt, body.messages and template_messages(body.messages),
            template_tools(body.tools), body.add_special_tokens, body.add_generation_prompt)
        out = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [router.tokenizer.decode([t], skip_special_tokens=False)
                                 for t in ids]
        return out

    @app.post("/detokenize", responses=openapi.errors(400, 401, 404, 413, 415),
              openapi_extra=openapi.request_body(DetokenizeRequest))
    async def detokenize(request: Request, who: str = Depends(caller)):
        body = await _body(parser, DetokenizeRequest, request)
        _check_model(body.model, model.name)
        return {"prompt": router.intake.detokenize(body.tokens)}

    return app


async def _body(parser: BodyParser, model: type, request: Request):
    """The validated body (415 unless it is JSON, 400 naming what is wrong)."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip()
    kind = kind.lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise HTTPException(415, f"Content-Type must be application/json, not {kind!r}")
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone while sending: nobody reads an answer
        raise HTTPException(499, "the client disconnected") from None
    return await parser.parse(model, raw)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ModelNotFoundError("model", f"model {requested!r} is not served here "
                                  f"(this server serves {served!r})")


async def _respond(router: Router, accepted: Accepted, shape, body, request: Request):
    stream = router.generate(accepted)
    if body.stream:
        first = await stream.__anext__()  # overload and worker errors get a real status
        return StreamingResponse(_sse(stream, first, shape, body), media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(stream))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not collect.done():  # the client hung up: cancelling ends the generator, whose
        collect.cancel()  # release aborts the request on its workers
        await asyncio.wait({collect})
        return Response(status_code=499)
    return JSONResponse(shape.full(collect.result()))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(stream) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def _sse(stream, first: TokenDelta, shape, body):
    deltas = [first]
    try:
        yield _event(shape.chunk(first))
        async for delta in stream:
            deltas.append(delta)
            yield _event(shape.chunk(delta))
        if body.stream_options and body.stream_options.include_usage:
            yield _event(shape.usage_chunk(deltas))
    except tuple(_FAILURES) as exc:  # the status is sent already: an error event
        status, kind = _FAILURES[_failure_type(exc)]
        yield _event(_error_body(status, str(exc), kind=kind))
    finally:
        await stream.aclose()  # a disconnect lands here: abort on both workers
    yield "data: [DONE]\n\n"


def _failure_type(exc: Exception) -> type:
    return next(t for t in _FAILURES if isinstance(exc, t))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _token_text(router: Router):
    return lambda token: router.tokenizer.decode([token], skip_special_tokens=False)


def _usage(accepted: Accepted, deltas: list[TokenDelta]) -> dict:
    completion = sum(len(d.token_ids) for d in deltas)
    cached = max((d.num_cached_tokens for d in deltas), default=0)
    prompt = len(accepted.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Shape:
    """One response's OpenAI envelope (id, object, created, model) around its
    choices: the whole response, a stream's chunk, and the stream's usage chunk. The
    deltas of an n > 1 request's choices come interleaved, each marked with its index;
    usage counts the prompt once."""
    PREFIX = OBJECT = CHUNK_OBJECT = ""

    def __init__(self, accepted: Accepted, model: str, body, router: Router):
        self.accepted, self.model, self.body, self.router = accepted, model, body, router
        self.id = f"{self.PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._begun: set[int] = set()  # choices whose first chunk went out
        self._scored = None  # the prompt's logprobs (choice 0's first delta brings them)

    def _envelope(self, obj: str, choices: list[dict],
                  usage_of: list[TokenDelta] | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if usage_of is not None:
            out["usage"] = _usage(self.accepted, usage_of)
        return out

    def full(self, deltas: list[TokenDelta]) -> dict:
        self._scored = _prompt_logprobs(deltas)  # every choice's echo shows them
        choices = [self._full_choice(own, index=i)
                   for i, own in enumerate(self._best(_by_choice(deltas)))]
        out = self._envelope(self.OBJECT, choices, deltas)
        scored = _prompt_logprobs(deltas)
        if isinstance(self.body, ChatRequest) and scored is not None:  # vLLM's place
            out["prompt_logprobs"] = _vllm_prompt_logprobs(
                scored, self.accepted.prompt_token_ids, _token_text(self.router))
        return out

    def chunk(self, delta: TokenDelta) -> dict:
        if self._scored is None:
            self._scored = delta.prompt_logprobs
        first = delta.index not in self._begun
        self._begun.add(delta.index)
        return self._envelope(self.CHUNK_OBJECT, [self._chunk_choice(delta, first)])

    def _best(self, choices: list[list[TokenDelta]]) -> list[list[TokenDelta]]:
        """best_of > n: the n choices with the highest mean logprob per token (OpenAI's
        rule), best first; else every choice, in index order."""
        n = self.body.n
        if len(choices) <= n:
            return choices
        def score(deltas: list[TokenDelta]) -> float:
            lps = [lp for d in deltas for lp in d.logprobs]
            return sum(lps) / len(lps) if lps else float("-inf")
        return sorted(choices, key=score, reverse=True)[:n]

    def usage_chunk(self, deltas: list[TokenDelta]) -> dict:
        return self._envelope(self.CHUNK_OBJECT, [], deltas)


class _CompletionShape(_Shape):
    PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"
    body: CompletionRequest

    def _full_choice(self, deltas: list[TokenDelta], first: bool = True,
                     index: int | None = None) -> dict:
        """first: the deltas start the answer (echo puts the prompt before them);
        index: its place in the answer (default: the deltas' choice index)."""
        ids = [t for d in deltas for t in d.token_ids]
        echo = self.body.echo and first
        prompt = self.accepted.prompt_token_ids if echo else []
        answer = (self._prompt_text() if echo else "") + "".join(d.text for d in deltas)
        choice = {"index": _index(deltas, index), "text": answer,
                  "finish_reason": deltas[-1].finish_reason if deltas else None,
                  "logprobs": None}
        scored = self._scored if first else None  # (streamed: on a choice's first chunk)
        if self.body.logprobs is not None:
            text = _token_text(self.router)
            lps = [lp for d in deltas for lp in d.logprobs]
            tops = [top for d in deltas for top in d.top_logprobs]
            if echo:  # the prompt's own, first (OpenAI's: null for its first token)
                entries = scored or [None] * len(prompt)
                lps = [None if e is None else e[0] for e in entries] + lps
                tops = [None if e is None else e[2] for e in entries] + tops
            ids = prompt + ids
            choice["logprobs"] = {
                "tokens": [text(t) for t in ids],
                "token_logprobs": lps,
                # As vLLM: the chosen token's too, so up to logprobs + 1 entries.
                "top_logprobs": [None if top is None else
                                 {text(u): v for u, v in {**top, t: lp}.items()}
                                 for t, lp, top in zip(ids, lps, tops)]
                if self.body.logprobs else None,
                "text_offset": None}
        if scored is not None and self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(
                scored, self.accepted.prompt_token_ids, _token_text(self.router))
        if self.body.return_token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return choice

    def _prompt_text(self) -> str:
        prompt = self.body.prompt_input()
        return prompt if isinstance(prompt, str) else self.router.tokenizer.decode(prompt)

    def _chunk_choice(self, delta: TokenDelta, first: bool) -> dict:
        return self._full_choice([delta], first)


def _prompt_logprobs(deltas: list[TokenDelta]):
    """The prompt's logprobs (the first delta of choice 0 carries them), if asked for."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)


def _by_choice(deltas: list[TokenDelta]) -> list[list[TokenDelta]]:
    """Each choice's deltas, in index order (one choice unless n > 1)."""
    by_index: dict[int, list[TokenDelta]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    return [by_index[i] for i in sorted(by_index)] or [[]]


def _vllm_prompt_logprobs(scored, prompt: list[int], text) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id:
    {logprob, rank, decoded_token}}, the prompt's token and the top ones."""
    out = []
    for token, entry in zip(prompt, scored):
        if entry is None:
            out.append(None)
            continue
        logprob, rank, tops = entry
        ranked = {t: (v, r) for r, (t, v) in enumerate(tops.items(), start=1)}
        ranked.setdefault(token, (logprob, rank))
        out.append({str(t): {"logprob": v, "rank": r, "decoded_token": text(t)}
                    for t, (v, r) in ranked.items()})
    return out


class _ChatShape(_Shape):
    PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"
    body: ChatRequest

    def __init__(self, *args):
        super().__init__(*args)
        self.tool_choice = self.body.resolved_tool_choice
        self._parsers: dict = {}  # streamed: each choice's text read as content and calls

    def _logprobs(self, deltas: list[TokenDelta]):
        if not self.body.logprobs:
            return None
        ids = [t for d in deltas for t in d.token_ids]
        lps = [lp for d in deltas for lp in d.logprobs]
        tops = [top for d in deltas for top in d.top_logprobs] or [{}] * len(ids)
        text = _token_text(self.router)
        return {"content": [
            {"token": text(t), "logprob": lp, "bytes": None,
             "top_logprobs": [{"token": text(u), "logprob": v, "bytes": None}
                              for u, v in top.items()]}
            for t, lp, top in zip(ids, lps, tops)]}

    def _extra(self, choice: dict, deltas: list[TokenDelta]) -> dict:
        if self.body.return_token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return choice

    def _full_choice(self, deltas: list[TokenDelta], index: int | None = None) -> dict:
        text = "".join(d.text for d in deltas)
        reason = deltas[-1].finish_reason if deltas else None
        message = {"role": "assistant", "content": text}
        if self.tool_choice != "none":
            content, calls = parse_tool_calls(text, self.body.tools, self.tool_choice)
            message["content"] = content
            calls = calls[:1] if self.body.parallel_tool_calls is False else calls
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                reason = self._calls_finish(reason)
        choice = {"index": _index(deltas, index), "finish_reason": reason,
                  "message": message, "logprobs": self._logprobs(deltas)}
        return self._extra(choice, deltas)

    def _chunk_choice(self, delta: TokenDelta, first: bool) -> dict:
        message: dict = {"content": delta.text}
        reason = delta.finish_reason
        if delta.index not in self._parsers:
            self._parsers[delta.index] = stream_parser(self.body.tools, self.tool_choice)
        parser = self._parsers[delta.index]
        if parser is not None:  # the text read as content and tool calls
            parts = parser.feed(delta.text) + (parser.finish() if delta.finished else [])
            calls = [call for part in parts for call in part.get("tool_calls", ())
                     if self.body.parallel_tool_calls is not False or call["index"] == 0]
            content = "".join(part.get("content", "") for part in parts)
            # a chunk of calls alone has no content (OpenAI's: null, not "")
            message = {"content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            if parser.has_calls:
                reason = self._calls_finish(reason)
        if first:
            message["role"] = "assistant"
        choice = {"index": delta.index, "delta": message, "finish_reason": reason,
                  "logprobs": self._logprobs([delta])}
        return self._extra(choice, [delta])

    def _calls_finish(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason for an answer of tool calls: "tool_calls" where the
        model chose to call (auto, required); a named choice's stays "stop"."""
        if reason == "stop" and self.tool_choice in ("auto", "required"):
            return "tool_calls"
        return reason


def _index(deltas: list[TokenDelta], index: int | None) -> int:
    return index if index is not None else deltas[0].index if deltas else 0
