"""The admin API under /admin: list the workers, add one of a role, drain, resume,
change a worker's role, remove it. Served only when admin keys are set (`pdserve
serve --admin-api-key`), and every call needs one (`Authorization: Bearer <key>`),
separate from the client keys: a client key cannot drain a pool. Errors are the
OpenAI-shaped JSON of the other routes."""
from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from pdserve.router.front.auth import ApiKeys
from pdserve.router.pool.placement import PlacementError
from pdserve.router.pool.pool import MembershipError, Pool
from pdserve.router.router import Router
from pdserve.worker.messages import ROLES

Role = Literal[ROLES]  # the one list, pdserve.worker.messages.ROLES


class AddWorker(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    wait: bool = Field(False, description="answer once the worker is in service (201) "
                       "rather than at once, with it pending (202)")


class ChangeRole(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role


class Drain(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout_s: float | None = Field(None, gt=0, le=86400,
                                    description="default: the router's --worker-drain-timeout-s")


def admin_routes(router: Router, keys: ApiKeys) -> APIRouter:
    def admin(request: Request) -> None:
        if keys.check(request.headers.get("authorization")) is None:
            raise HTTPException(401, "a valid admin API key is required "
                                "(Authorization: Bearer <key>)",
                                headers={"WWW-Authenticate": "Bearer"})

    api = APIRouter(prefix="/admin", dependencies=[Depends(admin)], tags=["admin"])
    pool = router.pool

    @api.get("/workers")
    async def list_workers():
        """Every worker: role, state, this router's load on it, its last telemetry;
        then the workers being added (pending: not yet placed by Ray; starting:
        loading) and the last few that failed to start, with why."""
        return {"workers": [*(describe(router, w) for w in router.workers),
                            *(describe(router, w) for w in list(pool.joining))]}

    @api.get("/workers/{worker_id}")
    async def show_worker(worker_id: str):
        if worker_id not in router.workers and worker_id not in pool.joining:
            raise HTTPException(404, f"no worker {worker_id!r}")
        return describe(router, worker_id)

    @api.post("/workers", status_code=202)
    async def add_worker(body: AddWorker, response: Response):
        """Starts a worker of the role; it is paired and subscribed before it gets
        traffic. Answers at once (202) with the new worker's id and state, "pending"
        until Ray places it, then "starting" (GET /admin/workers/{id} follows it);
        with "wait": true, once it is in service (201). A worker no node could ever
        hold is refused at once (503), one Ray does not place within the placement
        bound is abandoned, its reason shown."""
        worker_id = await _carried_out(pool, pool.add(body.role, wait=body.wait))
        if body.wait:
            response.status_code = 201
        else:
            response.headers["Location"] = f"/admin/workers/{worker_id}"
        return describe(router, worker_id)

    @api.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str, body: Drain | None = None):
        """No new requests; answers once this router's requests on it are done and,
        with other replicas, the worker reports holding none of theirs (504 if not
        within the timeout: it stays draining)."""
        await _carried_out(pool, pool.drain(worker_id, body.timeout_s if body else None))
        return describe(router, worker_id)

    @api.post("/workers/{worker_id}/resume")
    async def resume(worker_id: str):
        _raise_typed(lambda: pool.resume(worker_id))
        return describe(router, worker_id)

    @api.post("/workers/{worker_id}/role")
    async def change_role(worker_id: str, body: ChangeRole):
        """Drains the worker, switches its role (weights stay loaded), pairs it anew
        and resumes it."""
        await _carried_out(pool, pool.set_role(worker_id, body.role))
        return describe(router, worker_id)

    @api.delete("/workers/{worker_id}")
    async def remove(worker_id: str, body: Drain | None = None):
        """Drains the worker, then it leaves the cluster and its actor ends."""
        await _carried_out(pool, pool.remove(worker_id, body.timeout_s if body else None))
        return {"worker_id": worker_id, "removed": True}

    @api.get("/planner")
    async def planner():
        """The SLO planner: paused or not, its bounds, each pool's last signals and its
        recent decisions with their reasons and outcomes."""
        return _planner(router).describe()

    @api.post("/planner/pause")
    async def pause_planner():
        """It decides nothing until resumed (what it started goes on)."""
        _planner(router).paused = True
        return _planner(router).describe()

    @api.post("/planner/resume")
    async def resume_planner():
        _planner(router).paused = False
        return _planner(router).describe()

    return api


def _planner(router: Router):
    if router.planner is None:
        raise HTTPException(409, "this router runs no planner (pdserve serve --autoscale)")
    return router.planner


def describe(router: Router, worker_id: str) -> dict:
    if worker_id not in router.workers:  # being added, or failed to be
        joining = router.pool.joining.get(worker_id)
        if joining is None:  # its failure aged out of the few kept
            raise HTTPException(404, f"no worker {worker_id!r}")
        age_s = asyncio.get_running_loop().time() - joining.since
        return {"worker_id": worker_id, "role": joining.role, "state": joining.state,
                "age_s": round(age_s, 3), **({"error": joining.error} if joining.error
                                             else {})}
    w = router.workers[worker_id].state
    report = None
    if w.telemetry is not None:
        report = asdict(w.telemetry)
        for key in ("steps", "prefix_stored", "prefix_evicted"):
            report.pop(key)  # per-report deltas, not state
        report["age_s"] = round(router.clock.monotonic() - w.heard_at, 3)
    return {"worker_id": w.worker_id, "role": w.role,
            "state": router.worker_states()[w.worker_id], "inflight": w.inflight,
            "queued": w.queued, "queued_tokens": w.queued_tokens, "telemetry": report}


async def _carried_out(pool: Pool, call):
    """The operation's result, or its typed failure as HTTP; one the router's shutdown
    interrupts ends at once (503) rather than hold the drain."""
    operation = asyncio.ensure_future(call)
    closing = asyncio.ensure_future(pool.closing.wait())
    try:
        await asyncio.wait({operation, closing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
        if not operation.done():
            operation.cancel()
    if operation.cancelled() or not operation.done():  # cancel() takes a loop turn
        raise HTTPException(503, "the router is shutting down: the operation was "
                                 "cancelled")
    try:
        return operation.result()
    except (MembershipError, PlacementError) as exc:
        raise _as_http(exc) from None


def _raise_typed(fn):
    try:
        return fn()
    except MembershipError as exc:
        raise _as_http(exc) from None


def _as_http(exc: Exception) -> HTTPException:
    status = exc.status if isinstance(exc, MembershipError) else 503
    return HTTPException(status, str(exc))

