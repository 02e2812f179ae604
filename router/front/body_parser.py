"""HTTP request bodies parsed and validated off the router's event loop.

json and pydantic hold the GIL for the whole of a body (measured here: a 4 MB list of
token ids takes ~80 ms to parse and ~135 ms to validate), so a thread would stall the
event loop all the same. Bodies over INLINE_BYTES go to a one-process pool, which
also refuses, from its size alone, a prompt that cannot fit the context, so a huge
one never travels back. Smaller bodies, nearly all requests, are parsed inline,
where a process hop would cost more than it saves."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pydantic import BaseModel, ValidationError

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.validation import PromptLimits
from pdserve.router.errors import WorkerError

INLINE_BYTES = 256 << 10


class InvalidBody(ValueError):
    """The body is not JSON, or does not fit the request model (400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the top-level field is the param; the
    message is the most specific error (a union reports one per alternative)."""
    first = errors[0]
    loc = [p for p in first["loc"] if p != "body"]
    if not loc:
        return f"the body must be a JSON object: {first['msg']}", None
    same = [e for e in errors if [p for p in e["loc"] if p != "body"][:1] == loc[:1]]
    deepest = max(same, key=lambda e: len(e["loc"]))
    where = ".".join(str(p) for p in deepest["loc"] if p != "body")
    return f"{where}: {deepest['msg']}", str(loc[0])


def parse(model: type[BaseModel], raw: bytes, limits: PromptLimits):
    """The validated body, or (message, param) naming what is wrong. Runs in either
    place, so it returns errors as plain data."""
    try:
        # Python's parser, not pydantic's: it keeps what JSON's escapes can carry (a
        # lone surrogate), so the field's own check names the field.
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, too deep
        return f"the body is not valid JSON: {str(err)[:200]}", None
    try:
        body = model.model_validate(data)
        body.check_size(limits)
    except ValidationError as err:
        return validation_message(err.errors(include_url=False, include_input=False))
    except InvalidRequestError as err:
        return str(err), err.field
    return body


class BodyParser:
    def __init__(self, limits: PromptLimits):
        self.limits = limits
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, model: type[BaseModel], raw: bytes):
        if len(raw) <= INLINE_BYTES:
            result = parse(model, raw, self.limits)
        else:
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._executor(), parse, model, raw, self.limits)
            except BrokenProcessPool:  # its process died (memory?): a new one next time
                self._pool = None
                raise WorkerError("the body parser's process failed; retry") from None
        if isinstance(result, tuple):
            raise InvalidBody(*result)
        return result

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # spawned: no fork of a process holding Ray and threads
            self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
