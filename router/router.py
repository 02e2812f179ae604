"""The router, shared by the gRPC and HTTP front ends: a composition of its parts.

    intake.py          validation and tokenization (400 naming the field)
    request_runner.py  a request's flight through its phases, released once
    placer.py          the policy's decision on a snapshot, the ordered wait for capacity
    live_move.py       a draining worker's running requests moved off with their KV
    policy/            decide (pure), the goodput policy and its latency model
    pool/              membership, supervision and pairing of the workers; the
                       WorkerClient seam to them (Ray, or simulated)
    replicas/          what the replicas over one pool share (Redis, with --redis-url)
    planner/           the SLO planner, with --autoscale

The clock is passed in: the system's in production, virtual time in the simulator."""
from __future__ import annotations

import asyncio
import uuid

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.clock import SYSTEM_CLOCK, Clock
from pdserve.router.config import RouterConfig
from pdserve.router.intake import Intake
from pdserve.router.lifecycle import Accepted, Flight
from pdserve.router.live_move import LiveMover
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_info import ModelInfo
from pdserve.router.placer import Placer
from pdserve.router.planner.runner import PlannerRunner
from pdserve.router.planner.traffic import TrafficWindow, outcomes, refused
from pdserve.router.policy.cluster_models import ClusterModels
from pdserve.router.policy.decision import Decision, Reject
from pdserve.router.policy.latency_calibration import NONE
from pdserve.router.pool.pool import Pool
from pdserve.router.pool.spawner import Spawner
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.leader_lease import lease_for
from pdserve.router.replicas.pool_registry import PoolRecord, PoolRegistry, registry_for
from pdserve.router.replicas.request_directory import RequestDirectory, directory_for
from pdserve.router.replicas.shared_load import load_board_for
from pdserve.router.request_runner import RequestRunner
from pdserve.worker.messages import WorkerTelemetry

__all__ = ["Accepted", "Router"]


class Router:
    def __init__(self, tokenizer: Tokenizer | None, model: ModelInfo,
                 workers: list[WorkerHandle],
                 config: RouterConfig = RouterConfig(), spawner: Spawner | None = None,
                 clock: Clock = SYSTEM_CLOCK, router_id: str | None = None,
                 directory: RequestDirectory | None = None,
                 registry: PoolRegistry | None = None, record: PoolRecord | None = None):
        """tokenizer None: token ids in and out, no text (the simulator).
        workers: paired already (launch pairs them before traffic); `spawner`
        makes adding workers and replacing dead ones possible. router_id names this
        router to the workers, which stream it its own requests only, and to the other
        replicas. directory: which router holds each request, registry: the pool's
        membership as the replicas share it (defaults: what config.shared asks for;
        request_directory.py, pool_registry.py); record: the pool this router launched,
        registered on start (None: it joins one, or shares nothing)."""
        self.tokenizer, self.model, self.config, self.clock = tokenizer, model, config, clock
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.metrics = RouterMetrics(model.name)
        self.models = ClusterModels()
        # One replica leads (with --redis-url): its planner acts, and it replaces evicted
        # workers.
        self.lease = lease_for(config.shared, self.router_id)
        self.pool = Pool(config, self.router_id, spawner, on_report=self._reported,
                         on_leave=self._left, on_restart=self._restarted,
                         registry=registry or registry_for(config.shared, self.router_id),
                         may_replace=lambda: self.lease.leading)
        self.record = record
        self.load = load_board_for(config.shared, self.router_id)  # shared_load.py
        for worker in workers:
            self.pool.admit(worker)
        self.intake = Intake(tokenizer, model, config.routing.default_slo, clock)
        self.placer = Placer(self.pool, self.models, config, model, self.metrics, clock,
                             on_refused=self._refused)
        # A worker back in service may take what waits (a request moving off a dead one)
        self.pool.on_change.append(self.placer.queue.freed)
        self.directory = directory or directory_for(config.shared, self.router_id)
        self.requests = RequestRunner(self.pool, self.placer, self.models, self.metrics,
                                      config, tokenizer, clock, self._measured,
                                      self.directory)
        if config.routing.live_migration:  # a drain moves running requests off
            self.mover = LiveMover(self.pool, self.placer, self.metrics, config, clock,
                                   self.requests.abort_on)
            self.pool.evacuate = self.mover.evacuate
        # A request's way through: accept (or accept_chat), then generate.
        self.accept, self.accept_chat = self.intake.accept, self.intake.accept_chat
        self.traffic = TrafficWindow()  # what the planner reads of the load
        self.planner: PlannerRunner | None = None  # started by start() with --autoscale

    def generate(self, req: Accepted):
        """Streams the request's deltas (request_runner.RequestRunner.generate)."""
        self.traffic.arrived(self.clock.monotonic(), len(req.prompt_token_ids))
        return self.requests.generate(req)

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Ends an in-flight request of this owner (its stream ends with finish_reason
        "abort"), here or, through the directory, on the replica holding it; another
        caller's request is not found."""
        return (self.requests.abort(request_id, owner)
                or await self.directory.forward_abort(request_id, owner))

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        return self.pool.workers

    @property
    def on_change(self) -> list:
        """Called (on the event loop) whenever a worker leaves or rejoins service."""
        return self.pool.on_change

    @property
    def limits(self):
        return self.intake.limits

    @property
    def ready(self) -> bool:
        return self.pool.ready

    def worker_states(self) -> dict[str, str]:
        return self.pool.states()

    def forecast_of(self, request_id: str) -> Decision | None:
        """The decision an in-flight request was placed by, with its forecasts."""
        flight = self.requests.flights.get(request_id)
        return None if flight is None else flight.predicted

    @property
    def num_inflight(self) -> int:
        return len(self.requests.flights)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Returns once no request is in flight (True), or False after timeout_s."""
        try:
            await asyncio.wait_for(self.requests.idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def start(self) -> None:
        await self.pool.start(self.record)
        await self.load.start(self.pool.workers)
        await self.directory.start(self.requests.abort)
        await self.lease.start()
        spec = self.config.autoscale
        if spec.autoscale:
            roles = {w.state.role for w in self.pool.workers.values()}
            pools = ("both",) if roles <= {"both"} else ("prefill", "decode")
            sizes = getattr(self.pool.spawner, "tensor_parallel_size", None)
            devices = {role: sizes(role) for role in pools} if sizes else None
            self.planner = PlannerRunner(self.pool, spec.planner_config(pools, devices),
                                         self.config.routing.default_slo, self.traffic,
                                         self.metrics, self.lease)
            self.planner.start()

    async def stop(self) -> None:
        if self.planner is not None:
            await self.planner.stop()
        await self.lease.stop()
        await self.load.stop()
        last = await self.pool.stop()
        await self.requests.stop()
        await self.directory.stop()
        if last and self.pool.registry.shared:  # the pool ends with its last router
            for worker in self.pool.workers.values():
                worker.client.kill()

    async def refresh_stats(self) -> None:
        """What telemetry does not carry, for /metrics: the pools by role and state, and
        the decode side's KV lease expiries. (Load figures arrive with every step:
        WorkerTelemetry.)"""
        self.metrics.count_workers(self.pool.census())
        workers = list(self.pool.decode.values())
        results = await asyncio.gather(*[
            asyncio.wait_for(w.client.stats(), self.config.control_timeout_s)
            for w in workers], return_exceptions=True)
        stats = [r for r in results if not isinstance(r, BaseException)]
        for lease in stats[0].lease_expiries if stats else ():
            self.metrics.lease_expiries.labels(self.model.name, lease).set(
                sum(s.lease_expiries[lease] for s in stats))

    # ---- what the router learns ------------------------------------------------------

    def _reported(self, worker: WorkerHandle, telemetry: WorkerTelemetry) -> None:
        previous = worker.state.telemetry
        now = self.clock.monotonic()
        self.metrics.observe_worker(telemetry)
        step_cost, prompt_share = self.models.reported(telemetry)
        worker.update(telemetry=telemetry, heard_at=now, step_cost=step_cost,
                      prompt_share=prompt_share,
                      calibration=self.models.calibration(worker.worker_id, now))
        self.models.age_transfers(now)
        if previous is None or telemetry.free_blocks > previous.free_blocks \
                or telemetry.running < previous.running:
            self.placer.queue.freed()  # not on every step: waiters would be asked in vain

    def _measured(self, flight: Flight, ttft_s: float, tpot_s: float | None) -> None:
        now = self.clock.monotonic()
        self.traffic.finished(now, flight.num_output_tokens)
        # The planner's attainment: each pool on the term it answers for (a moved
        # request's latencies are no one placement's).
        decode, prefill = flight.decode, flight.prefill or flight.decode
        if not flight.migrations and decode is not None:
            self.traffic.judged(now, outcomes(prefill.state.role, decode.state.role,
                                              flight.req.slo, ttft_s, tpot_s))
        decision = flight.predicted
        if not self.config.routing.calibrate or decision is None or flight.migrations:
            return  # a moved request's latencies are no one placement's
        learned = self.models.request_finished(
            decision, flight.placed_at - flight.req.arrival_time, ttft_s, tpot_s,
            self.clock.monotonic(), self.pool.workers)
        for worker_id, calibration in learned.items():
            self.pool.workers[worker_id].update(calibration=calibration)

    def _refused(self, decision: Reject) -> None:
        """A request refused for want of capacity: a miss of the pools that lacked it."""
        roles = {worker.state.role for worker in self.pool.workers.values()}
        self.traffic.judged(self.clock.monotonic(), refused(decision.kind, roles))

    def _left(self, worker: WorkerHandle) -> None:
        self.metrics.forget_worker(worker.worker_id)
        self.models.forget(worker.worker_id)

    def _restarted(self, worker: WorkerHandle) -> None:
        """A new process (maybe on another node): its prefix cache is empty, and what
        was measured of the old one (steps, transfers, calibration) is forgotten."""
        self.models.forget(worker.worker_id)
        worker.update(step_cost=None, prompt_share=0.0, calibration=NONE)
