"""Router-level failures a front end maps to a status (429 / RESOURCE_EXHAUSTED,
503 / UNAVAILABLE). Bad input is engine.errors.InvalidRequestError (400)."""


class OverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerError(RuntimeError):
    """A worker failed the request (transfer error, worker death, timeout)."""
