"""Typed errors the engine and its workers raise for a caller to translate."""


class InvalidRequestError(ValueError):
    """A request or sampling field is out of range. `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # crosses the Ray boundary with its field
        return type(self), (self.field, self.message)


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (404, as OpenAI)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)


class RequestFailedError(RuntimeError):
    """A step failed for this request alone (500 / INTERNAL); the worker and every
    other request in the step go on."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.request_id, self.reason)


class WrongRoleError(RuntimeError):
    """A call the worker's current role does not take (a router raced a role change)."""


class WorkerBusyError(RuntimeError):
    """A role change asked of a worker that still holds requests."""


class MoveError(RuntimeError):
    """A live migration step a worker cannot carry out (the request is not where or as
    the call expects, no room for it, its blocks changed under a copy): the router
    falls back to replay."""
