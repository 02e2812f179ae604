"""Router-level failures a front end maps to a status (429 / RESOURCE_EXHAUSTED,
503 / UNAVAILABLE). Bad input is engine.errors.InvalidRequestError (400)."""
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


def cause_of(exc: BaseException) -> BaseException:
    """The worker-side exception behind a Ray task error (Ray keeps it as `cause`)."""
    return getattr(exc, "cause", None) or exc


_DEATHS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")


def is_worker_death(exc: BaseException) -> bool:
    """Whether a call failed because the worker's process died or is restarting."""
    cause = cause_of(exc)
    return type(cause).__module__.startswith("ray") and type(cause).__name__ in _DEATHS


def short_reason(exc: BaseException) -> str:
    """What a client may see of a worker failure: the error type and its first line,
    never a traceback, pid, address or path."""
    cause = cause_of(exc)
    if type(cause).__module__.startswith("ray"):  # its text names pids, addresses, ids
        return "the worker died" if is_worker_death(cause) else "the worker failed"
    if isinstance(cause, TimeoutError):
        return "the worker did not answer in time"
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
