"""Router-level failures a front end maps to a status (429 / RESOURCE_EXHAUSTED,
503 / UNAVAILABLE). Bad input is engine.errors.InvalidRequestError (400). A worker's
own errors reach the router as the worker raised them (the WorkerClient seam unwraps
its transport's), so nothing here knows of Ray."""
from __future__ import annotations


class OverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class WorkerError(RuntimeError):
    """A worker failed the request (transfer error, worker death, timeout)."""


class WorkerStalled(WorkerError):
    """A worker holding requests produced no step within the stall bound."""


class NotMoved(WorkerError):
    """A request moving off a failed worker found no other to take it in time."""


class WorkerDied(WorkerError):
    """The worker's process died or is restarting (a WorkerClient raises it for any
    call the process could not answer)."""


def short_reason(exc: BaseException) -> str:
    """What a client may see of a worker failure: the error type and its first line,
    never a traceback, pid, address or path."""
    if isinstance(exc, WorkerDied):
        return "the worker died"
    if isinstance(exc, TimeoutError):
        return "the worker did not answer in time"
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
