"""Runs the SLO planner (core.py) every interval against this router's pool and
carries its actions out through the Pool: an added worker joins draining and gets
traffic once paired; a removed one is drained first (no running request is cut), or,
still starting, given up; a flipped one is drained, then changes role with its
weights loaded. One planner acts per cluster: the router that runs it. Each decision
is logged on one line and the last ones are kept, with how they ended, for `pdserve
admin planner`, which also pauses and resumes it."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import asdict

from pdserve.router.errors import short_reason
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner.core import (
    Action,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    WorkerView,
    plan,
)
from pdserve.router.planner.traffic import TrafficWindow
from pdserve.router.pool.pool import Pool
from pdserve.router.replicas.leader_lease import LeaderLease, SoleLeader
from pdserve.router.slo import Slo

log = logging.getLogger(__name__)

KEPT_DECISIONS = 100
# Pool.states() -> the planner's states
_STATES = {"serving": "serving", "draining": "draining", "stalled": "stalled",
           "restarting": "stalled", "dead": "stalled"}


class PlannerRunner:
    def __init__(self, pool: Pool, config: PlannerConfig, slo: Slo, traffic: TrafficWindow,
                 metrics: RouterMetrics, lease: LeaderLease = SoleLeader()):
        """lease: whether this router's planner is the one that acts (leader_lease.py)."""
        self.pool, self.config, self.slo = pool, config, slo
        self.traffic, self.metrics, self.lease = traffic, metrics, lease
        self.state = PlannerState()
        self.paused = False
        self.last: Plan | None = None
        self.decisions: deque = deque(maxlen=KEPT_DECISIONS)  # dicts, oldest first
        self._acting: dict[str, tuple[str, str, float]] = {}  # worker -> (kind, role, since)
        self._tasks: set[asyncio.Task] = set()
        self._ticking: asyncio.Task | None = None

    def start(self) -> None:
        self._ticking = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in [self._ticking, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._ticking, *self._tasks] if t is not None],
                             return_exceptions=True)
        await self.lease.stop()

    async def settled(self) -> None:
        """Returns once every action started so far has ended (its outcome recorded)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _run(self) -> None:
        await self.lease.start()
        led = True
        while not self.pool.closing.is_set():
            await asyncio.sleep(self.config.interval_s)  # the planner's period
            if not self.lease.leading:
                led = False  # another replica's planner acts
                continue
            if not led:  # what it sustained before another led is stale
                self.state, led = PlannerState(), True
            if self.paused or self.pool.closing.is_set():
                continue
            try:
                self.tick()
            except Exception:  # a bug in one tick must not end the planner
                log.exception("planner: the tick failed; the next one tries again")

    def tick(self) -> Plan:
        out = plan(self.observe(), self.state, self.config)
        self.state, self.last = out.state, out
        for action in out.actions:
            self._carry_out(action)
        for role, n in out.desired.items():
            self.metrics.planner_desired.labels(self.metrics.model_name, role).set(n)
        return out

    def observe(self) -> Observation:
        now = asyncio.get_running_loop().time()
        states = self.pool.states()
        views = []
        for worker_id, worker in self.pool.workers.items():
            acting = self._acting.get(worker_id)
            if acting is not None:
                kind, role, since = acting
                if kind == "flip":  # capacity on its way to its new pool
                    views.append(WorkerView(worker_id, role, "starting", now - since))
                continue  # a removal: leaving
            s, report = worker.state, worker.state.telemetry
            kv = (1 - report.free_blocks / report.num_blocks
                  if report is not None and report.num_blocks else 0.0)
            views.append(WorkerView(worker_id, s.role, _STATES.get(states[worker_id], "stalled"),
                                    now - worker.serving_since, s.step_cost, s.reported_load,
                                    kv))
        for worker_id, joining in self.pool.joining.items():
            if joining.state in ("pending", "starting") and worker_id not in self._acting:
                views.append(WorkerView(worker_id, joining.role, "starting",
                                        now - joining.since))
        started = sorted(self.pool.startup_times)
        return Observation(now, tuple(views), self.traffic.traffic(now), self.slo,
                           started[len(started) // 2] if started else None)

    def describe(self) -> dict:
        signals = {} if self.last is None else {
            role: asdict(signal) for role, signal in self.last.signals.items()}
        return {"paused": self.paused, "leading": self.lease.leading,
                "interval_s": self.config.interval_s,
                "bounds": {role: [self.config.minimum(role), self.config.maximum(role)]
                           for role in self.config.roles},
                "max_workers": self.config.max_workers, "signals": signals,
                "decisions": list(self.decisions)}

    # ---- carrying actions out ----------------------------------------------------------

    def _carry_out(self, action: Action) -> None:
        loop = asyncio.get_running_loop()
        log.warning("planner: %s %s%s (%s): %s", action.kind, action.role,
                    f" {action.worker_id}" if action.worker_id else "", action.cause,
                    action.reason)
        self.metrics.planner_decisions.labels(self.metrics.model_name, action.kind, action.role,
                                              action.cause).inc()
        record = {"at_s": round(loop.time(), 3), "action": action.kind, "role": action.role,
                  "worker_id": action.worker_id, "cause": action.cause,
                  "reason": action.reason, "outcome": "under way"}
        self.decisions.append(record)
        calls = {"add": lambda: self.pool.add(action.role, wait=False),
                 "remove": lambda: self.pool.remove(action.worker_id),
                 "flip": lambda: self.pool.set_role(action.worker_id, action.role)}
        if action.kind != "add":
            self._acting[action.worker_id] = (action.kind, action.role, loop.time())
        task = loop.create_task(self._settle(record, action, calls[action.kind],
                                             self.lease.token))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, record: dict, action: Action, call, token: int) -> None:
        """Carries the action out if this planner still leads (its fencing token holds),
        and records how it ended."""
        try:
            if not await self.lease.still_leading(token):
                record["outcome"] = "fenced: another replica's planner leads"
                return
            result = await call()
        except asyncio.CancelledError:
            record["outcome"] = "cancelled"
            raise
        except Exception as exc:
            record["outcome"] = f"failed: {short_reason(exc)}"
            log.error("planner: %s %s%s failed: %s", action.kind, action.role,
                      f" {action.worker_id}" if action.worker_id else "", short_reason(exc))
            if action.kind == "flip" and action.worker_id in self.pool.workers:
                self.pool.resume(action.worker_id)  # it stays in its old role, serving
        else:
            record["outcome"] = "done" if action.kind != "add" else "started"
            if action.kind == "add":
                record["worker_id"] = result
        finally:
            self._acting.pop(action.worker_id, None)
