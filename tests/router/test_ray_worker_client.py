"""The Ray seam translates Ray's failures so nothing past it knows of Ray: a dead or
restarting actor is WorkerDied, a worker's own error arrives as itself, anything
else is a WorkerError whose text names no pid or address. (No Ray cluster needed:
the exceptions are built as Ray builds them.)"""
from __future__ import annotations

import ray.exceptions as ray_errors

from pdserve.engine.errors import InvalidRequestError
from pdserve.kv_transfer import TransferTimeout
from pdserve.router.errors import WorkerDied, WorkerError, short_reason
from pdserve.router.pool.ray_worker_client import translated


def test_a_dead_actor_is_worker_died():
    for exc in (ray_errors.ActorDiedError(),
                ray_errors.RayTaskError("reserve", "tb", ray_errors.ActorDiedError())):
        assert isinstance(translated(exc), WorkerDied)
    assert short_reason(WorkerDied("x")) == "the worker died"


def test_a_worker_s_own_error_arrives_as_itself():
    for cause in (InvalidRequestError("top_p", "must be in (0, 1]"),
                  TransferTimeout("r1", "late")):
        wrapped = ray_errors.RayTaskError("prefill", "traceback (pid=42)", cause)
        assert translated(wrapped.as_instanceof_cause()) is cause


def test_any_other_ray_failure_is_a_worker_error_naming_nothing():
    error = translated(ray_errors.RaySystemError("raylet at 10.0.0.7:6379 (pid 4242)"))
    assert type(error) is WorkerError and "10.0.0.7" not in str(error)
