"""The SLO planner: how many workers each pool needs, decided every interval from
what the workers report and what the latency model forecasts. Pure: an Observation
(time included) and the planner's own state in, actions with their reasons out; the
caller gathers the observation and carries the actions out through the Pool.

Pools are roles: prefill (its SLO: TTFT), decode (TPOT and KV) and both (colocated:
either). For each pool, from its serving workers past their cold start:

    short  every one of them forecasts a miss (prefill: a typical prompt's TTFT behind
           its queue; decode: the TPOT of a request joining its batch, or its KV
           nearly full), or the demand below needs more workers than the pool has
    spare  the pool's load spread over one worker fewer still forecasts within
           margin x SLO on every term (the consolidation check that ends 2 <-> 1
           oscillation), the demand sized at margin x SLO fits one worker fewer,
           and its recent requests met their SLOs at least as often as
           attainment_target (what the forecasts call spare, the outcome may not be:
           they are sized at the SLO's mean)
    demand the workers the arrival rate a start-up ahead needs (demand.py:
           sized with the pool's measured step cost; ISL: prompt tokens not cached,
           decode context ISL + OSL/2). Growth reads it at the SLO, shrinking at
           margin x SLO: the band between them is where a pool holds. With a
           load_factor above 1 each worker is counted on for that many times the
           load the model gives it within the SLO: the pools are sized to miss at
           the peaks, spending the misses an attainment goal below 100% allows

A signal acts once it held for `sustain` ticks in a row (shrinking: `down_sustain`).
A short pool takes a worker flipped from a pool that can spare one (its weights stay
loaded) before a new one is added. A miss grows it by one, and not while a worker of
its own is still coming (starting, or serving for less than cold_start_s: capacity
on its way, not yet in the reports); the demand, which counts the coming workers,
gets all the workers it lacks at once (a new one serves only a start-up later).
A pool that grew is not shrunk for reversal_guard_s after its new worker would
serve (a start-up after it was asked for: a worker still starting is not given up
on a forecast that moved within the start-up); one that shrinks gives up a worker
still starting first, so a worker stuck starting never blocks scale-down for longer.
Bounds hold at every tick: a pool below its minimum gets a worker at once, the pools
never exceed their maxima, and all together never the budget (max_workers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pdserve.engine.latency_model import StepCost
from pdserve.router.planner.demand import KV_FULL, need, worst_cost
from pdserve.router.policy.latency_forecast import WorkerLoad, tpot_seconds, ttft_seconds
from pdserve.router.slo import Slo


@dataclass(frozen=True)
class PlannerConfig:
    roles: tuple[str, ...] = ("prefill", "decode")  # the pools it sizes; ("both",) colocated
    min_workers: tuple[tuple[str, int], ...] = (("prefill", 1), ("decode", 1), ("both", 1))
    max_workers_per_pool: tuple[tuple[str, int], ...] = (("prefill", 8), ("decode", 8),
                                                         ("both", 8))
    max_workers: int = 8  # the budget, every pool together
    # The devices a worker of each pool holds (its tensor_parallel_size; 1 if unsaid).
    # A pool's worker flips only to a pool of as many; max_devices (0: none) bounds
    # the devices of every pool together, as max_workers does the workers.
    devices_per_worker: tuple[tuple[str, int], ...] = ()
    max_devices: int = 0
    interval_s: float = 5.0
    sustain: int = 2  # ticks a short pool must stay short
    down_sustain: int = 6  # ticks a pool must stay able to spare one
    margin: float = 0.8  # a pool shrinks only if one fewer stays within this share of the SLO
    cold_start_s: float = 10.0  # a new worker's first reports are not read
    # How long a new worker takes to serve, until one was measured: demand looks
    # this far ahead.
    startup_s: float = 30.0
    reversal_guard_s: float = 60.0  # a pool that grew is not shrunk sooner
    # A pool whose recent requests met their SLOs less often than this (read once
    # min_judged of them ended) is not shrunk.
    attainment_target: float = 0.9
    min_judged: int = 20
    # How many times the load the latency model says a worker carries within the SLO
    # it is counted on for. 1: every moment sized to meet the SLO (each request at its
    # mean); above 1 the pools run past it at the peaks and meet the SLOs less often
    # (docs/simulator.md: on the H100 profile's sinusoid 1.25 met 0.90-0.93 at
    # 0.76-0.81x the worker-seconds of the cheapest static pool at 90%, 1 met 0.95 at
    # 0.89x; the right value depends on the profile and the load); below 1, headroom.
    load_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.roles or any(r not in ("prefill", "decode", "both") for r in self.roles):
            raise ValueError(f"roles must be prefill / decode / both, not {self.roles!r}")
        for role in self.roles:
            if not 0 <= self.minimum(role) <= self.maximum(role):
                raise ValueError(f"the {role} pool needs 0 <= min <= max")
        if sum(self.minimum(r) for r in self.roles) > self.max_workers:
            raise ValueError("the pools' minima exceed max_workers")
        if any(self.devices(r) < 1 for r in self.roles) or self.max_devices < 0:
            raise ValueError("devices_per_worker must be >= 1 and max_devices >= 0")
        if self.max_devices and sum(self.minimum(r) * self.devices(r)
                                    for r in self.roles) > self.max_devices:
            raise ValueError("the pools' minima exceed max_devices")
        if not (self.sustain >= 1 and self.down_sustain >= 1 and 0 < self.margin <= 1):
            raise ValueError("sustain and down_sustain must be >= 1, margin in (0, 1]")
        if not (0 <= self.attainment_target <= 1 and self.min_judged >= 1):
            raise ValueError("attainment_target must be in [0, 1], min_judged >= 1")
        if not self.load_factor > 0:
            raise ValueError(f"load_factor must be > 0, not {self.load_factor!r}")
        for name in ("interval_s", "cold_start_s", "startup_s", "reversal_guard_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def minimum(self, role: str) -> int:
        return dict(self.min_workers).get(role, 0)

    def maximum(self, role: str) -> int:
        return dict(self.max_workers_per_pool).get(role, self.max_workers)

    def devices(self, role: str) -> int:
        return dict(self.devices_per_worker).get(role, 1)


# ---- what it observes --------------------------------------------------------------

@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str
    state: str  # serving | starting (pending placement included) | draining | stalled
    age_s: float  # serving: since it joined; starting: since it was asked for
    cost: StepCost | None = None  # its fitted step cost (None: nothing fitted)
    load: WorkerLoad = WorkerLoad()
    kv_used: float = 0.0  # share of its KV blocks held (decoding roles)


@dataclass(frozen=True)
class Traffic:
    """Over the recent window."""
    rate: float = 0.0  # requests per second
    rate_slope: float = 0.0  # its trend, requests per second per second
    isl: float = 0.0  # mean prompt tokens not cached
    osl: float = 0.0  # mean output tokens
    # A load that repeats (traffic.py finds its period): the arrival rate in each bin
    # of echo_bin_s over the last period and the `echo_lead` bins before it, up to
    # the last whole bin, which ended echo_age_s ago. Empty: none found.
    echo: tuple[float, ...] = ()
    echo_bin_s: float = 0.0
    echo_lead: int = 0
    echo_age_s: float = 0.0
    # Requests that ended over the last few seconds (finished, or refused for want of
    # capacity), per pool: (role, met their SLO there, judged). traffic.outcomes and
    # traffic.refused say which pool answers for what.
    judged: tuple[tuple[str, int, int], ...] = ()

    def attainment(self, role: str) -> tuple[int, int]:
        """(met, judged) of the pool's recent requests."""
        return next(((met, n) for r, met, n in self.judged if r == role), (0, 0))

    def ahead(self, horizon_s: float) -> float:
        """The arrival rate `horizon_s` from now: where the load repeats, the course
        it took one period ago from that moment on, shifted by how much the rate of
        the last `echo_lead` bins differs from theirs one period before (a horizon
        past one period reads the period's end); else the recent trend."""
        if not self.echo:
            return max(self.rate + self.rate_slope * horizon_s, 0.0)
        lead, echo = self.echo_lead, self.echo
        shift = (sum(echo[-lead:]) - sum(echo[:lead])) / lead
        k = min(lead + int((horizon_s + self.echo_age_s) // self.echo_bin_s), len(echo) - 1)
        near = echo[max(k - 1, lead):k + 2]  # its bin and its neighbours
        return max(sum(near) / len(near) + shift, 0.0)


@dataclass(frozen=True)
class Observation:
    now_s: float
    workers: tuple[WorkerView, ...]
    traffic: Traffic
    slo: Slo  # what the server routes with (unset parts: that pool is sized on demand)
    # How long the last workers took from asked for to serving (None: not measured
    # yet, config.startup_s stands in): how far ahead the demand looks.
    startup_s: float | None = None


# ---- what it decides ---------------------------------------------------------------

CAUSES = ("minimum", "maximum", "miss", "demand", "spare")


@dataclass(frozen=True)
class Action:
    kind: str  # add | remove | flip
    role: str  # add: the pool grown; remove: the pool shrunk; flip: the pool it joins
    cause: str  # CAUSES: a bound, a forecast miss, the demand, a pool that can spare one
    reason: str  # the figures behind it, for people
    worker_id: str = ""  # remove, flip: which worker


@dataclass(frozen=True)
class PoolSignal:
    """One pool's reading at one tick, kept for diagnostics (admin planner)."""
    members: int  # serving, starting and stalled (not draining)
    coming: int  # starting, or serving for less than cold_start_s
    short: str  # why it is short ("" if it is not)
    short_cause: str  # miss | demand ("" if it is not short)
    spare: str  # why it could lose one ("" if it cannot)
    demand: int  # workers the demand needs at the SLO (0: unknown)
    keep: int  # workers it needs at margin x SLO: the pool shrinks only below this
    met: int = 0  # of its requests that ended over the last few seconds, those that
    judged: int = 0  # met their SLOs there, and all


@dataclass(frozen=True)
class PlannerState:
    short_ticks: dict = field(default_factory=dict)  # role -> ticks in a row short
    spare_ticks: dict = field(default_factory=dict)  # role -> ticks in a row able to spare
    grew_at: dict = field(default_factory=dict)  # role -> when it last gained a worker


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    state: PlannerState
    signals: dict  # role -> PoolSignal
    desired: dict  # role -> its workers once the actions are carried out


def plan(obs: Observation, state: PlannerState, config: PlannerConfig) -> Plan:
    signals = {role: _signal(role, obs, config) for role in config.roles}
    # While a worker of a pool is coming, a miss does not count: the capacity on its
    # way must show in the reports before more is asked for. The demand counts the
    # coming workers among the pool's already.
    short_ticks = {r: state.short_ticks.get(r, 0) + 1 if signals[r].short and (
                   not signals[r].coming or signals[r].short_cause == "demand") else 0
                   for r in config.roles}
    spare_ticks = {r: state.spare_ticks.get(r, 0) + 1 if signals[r].spare else 0
                   for r in config.roles}
    counts = {r: signals[r].members for r in config.roles}
    grew_at = dict(state.grew_at)
    actions: list[Action] = []
    taken: set[str] = set()  # workers an action already names

    def total() -> int:
        return sum(counts.values())

    def room(role: str) -> bool:
        """One more worker of `role` fits the budgets (workers, and devices)."""
        devices = sum(n * config.devices(r) for r, n in counts.items())
        return total() < config.max_workers and (
            not config.max_devices or devices + config.devices(role) <= config.max_devices)

    def gain(role: str, action: Action) -> None:
        actions.append(action)
        counts[role] += 1
        grew_at[role] = obs.now_s
        short_ticks[role] = 0

    def lose(role: str, worker_id: str) -> None:
        counts[role] -= 1
        taken.add(worker_id)
        spare_ticks[role] = 0

    for role in config.roles:  # bounds first, at once
        while counts[role] < config.minimum(role) and room(role):
            gain(role, Action("add", role, "minimum",
                              f"below its minimum of {config.minimum(role)}"))
        while counts[role] > config.maximum(role):
            victim = _victim(obs, role, taken)
            if victim is None:
                break
            lose(role, victim)
            actions.append(Action("remove", role, "maximum", f"above its maximum of "
                                  f"{config.maximum(role)}", victim))
    lent: set[str] = set()  # pools that gave a worker this tick (each can spare one)
    for role in config.roles:
        signal = signals[role]
        if short_ticks[role] < config.sustain:
            continue
        why = f"{signal.short} for {short_ticks[role]} ticks"
        # A miss grows the pool by one, then waits to see it; the demand gets what it
        # needs at once (a new worker serves only a start-up later).
        wanted = signal.demand - counts[role] if signal.short_cause == "demand" else 1
        for _ in range(wanted):
            if counts[role] >= config.maximum(role):
                break
            donor = _donor(role, obs, config, signals, counts, taken, lent)
            if donor is not None:
                donor_role, worker_id = donor
                lose(donor_role, worker_id)
                lent.add(donor_role)
                gain(role, Action("flip", role, signal.short_cause, f"{why}; the "
                                  f"{donor_role} pool can spare one "
                                  f"({signals[donor_role].spare})", worker_id))
            elif room(role):
                gain(role, Action("add", role, signal.short_cause, why))
            else:
                break
    for role in config.roles:
        signal = signals[role]
        guarded_until = grew_at.get(role, -math.inf) + _startup(obs, config) \
            + config.reversal_guard_s
        if spare_ticks[role] < config.down_sustain or counts[role] <= config.minimum(role) \
                or obs.now_s < guarded_until or any(a.role == role for a in actions):
            continue
        victim = _victim(obs, role, taken)
        if victim is not None:
            lose(role, victim)
            actions.append(Action("remove", role, "spare", f"{signal.spare} for "
                                  f"{config.down_sustain} ticks", victim))
    return Plan(tuple(actions), replace(state, short_ticks=short_ticks,
                                        spare_ticks=spare_ticks, grew_at=grew_at), signals,
                dict(counts))


# ---- one pool's signals ------------------------------------------------------------

def _signal(role: str, obs: Observation, config: PlannerConfig) -> PoolSignal:
    members = [w for w in obs.workers if w.role == role and w.state != "draining"]
    coming = [w for w in members if w.state == "starting"
              or (w.state == "serving" and w.age_s < config.cold_start_s)]
    warm = [w for w in members if w.state == "serving" and w.age_s >= config.cold_start_s
            and w.cost is not None]
    # Grown when the demand needs more workers at the SLO, shrunk only when it fits
    # one fewer at margin x SLO: between the two a pool holds (no 2 <-> 1 flapping).
    # Growth looks a start-up ahead (a new worker serves that much later); shrinking
    # does not run ahead of a falling load (a worker drains at once, and a rise back
    # would wait a start-up), so it reads the larger of now and ahead.
    ahead, t, f = _rate_ahead(obs, config), obs.traffic, config.load_factor
    demand = math.ceil(need(role, warm, obs.slo, t.isl, t.osl, ahead, 1.0, f) - 1e-9)
    keep = math.ceil(need(role, warm, obs.slo, t.isl, t.osl, max(ahead, t.rate),
                          config.margin, f) - 1e-9)
    short, cause = _short(role, warm, obs, config), "miss"
    if not short and demand > len(members):
        factor = f", at {f:g} x a worker's load" if f != 1 else ""
        short, cause = (f"the demand needs {demand} workers, it has {len(members)} "
                        f"({ahead:.1f} req/s a start-up ahead, now "
                        f"{t.rate:.1f}; ISL {t.isl:.0f}, OSL {t.osl:.0f}{factor})"), "demand"
    met, judged = t.attainment(role)
    behind = judged >= config.min_judged and met < config.attainment_target * judged
    spare = "" if behind or keep >= len(members) else _spare(role, warm, members, obs, config)
    return PoolSignal(len(members), len(coming), short, cause if short else "", spare,
                      demand, keep, met, judged)


def _short(role: str, warm: list[WorkerView], obs: Observation, config: PlannerConfig) -> str:
    """Why every warm worker of the pool forecasts a miss ("" if one does not)."""
    if not warm:
        return ""
    t, slo = obs.traffic, obs.slo
    isl, osl = max(int(t.isl), 1), max(int(t.osl), 1)
    first = ""
    for w in warm:
        why = ""
        if role in ("prefill", "both") and slo.ttft_s is not None:
            ttft = ttft_seconds(w.cost, w.load, isl)
            if ttft > slo.ttft_s:
                why = f"TTFT forecast {ttft * 1e3:.0f} ms > SLO {slo.ttft_s * 1e3:g} ms"
        if not why and role in ("decode", "both"):
            tpot = tpot_seconds(w.cost, w.load, isl, osl)
            if slo.tpot_s is not None and tpot > slo.tpot_s:
                why = f"TPOT forecast {tpot * 1e3:.1f} ms > SLO {slo.tpot_s * 1e3:g} ms"
            elif w.kv_used >= KV_FULL:
                why = f"KV {w.kv_used:.0%} full"
        if not why:
            return ""
        first = first or why
    return f"every {role} worker misses (e.g. {first})"


def _spare(role: str, warm: list[WorkerView], members: list[WorkerView], obs: Observation,
           config: PlannerConfig) -> str:
    """Why the pool's load fits one worker fewer within margin x SLO ("" if it does
    not, or nothing can be said of it: a serving worker still cold, or stalled). The
    one given up is a starting worker if there is one (it carries nothing)."""
    starting = sum(w.state == "starting" for w in members)
    serving = len(members) - starting
    if not members or len(warm) < serving:
        return ""
    left = serving if starting else serving - 1  # serving workers after giving one up
    load = _total_load(warm) if warm else WorkerLoad()
    if left == 0:
        idle = not (load.queued_tokens or load.decode_seqs) and obs.traffic.rate == 0
        return "no traffic and nothing running" if idle else ""
    spread = _spread(load, left)
    t, slo, m = obs.traffic, obs.slo, config.margin
    isl, osl = max(int(t.isl), 1), max(int(t.osl), 1)
    cost = worst_cost(warm)
    terms = []
    if role in ("prefill", "both") and slo.ttft_s is not None:
        ttft = ttft_seconds(cost, spread, isl)
        if ttft > m * slo.ttft_s:
            return ""
        terms.append(f"TTFT {ttft * 1e3:.0f} ms")
    if role in ("decode", "both"):
        tpot = tpot_seconds(cost, spread, isl, osl)
        if slo.tpot_s is not None and tpot > m * slo.tpot_s:
            return ""
        kv = sum(w.kv_used for w in warm) / left
        if kv > m:
            return ""
        terms.append(f"TPOT {tpot * 1e3:.1f} ms, KV {kv:.0%}")
    return f"at {left} serving worker(s) it forecasts {', '.join(terms)} " \
           f"(within {m:g} x SLO)"


def _rate_ahead(obs: Observation, config: PlannerConfig) -> float:
    """The arrival rate (on the last period's course, or the recent trend) when a
    worker asked for on this signal would serve: once the signal has held (sustain -
    1 more ticks), a start-up later."""
    return obs.traffic.ahead(_startup(obs, config) + (config.sustain - 1) * config.interval_s)


def _startup(obs: Observation, config: PlannerConfig) -> float:
    """How long a worker asked for now takes to serve: as the last ones took, or the
    configured guess before any did."""
    return config.startup_s if obs.startup_s is None else obs.startup_s


def _victim(obs: Observation, role: str, taken: set[str]) -> str | None:
    """Which worker a shrinking pool gives up: one still starting (it carries
    nothing, and may never start), else the least loaded serving one."""
    members = [w for w in obs.workers if w.role == role and w.worker_id not in taken
               and w.state in ("starting", "serving", "stalled")]
    if not members:
        return None
    order = {"starting": 0, "stalled": 1, "serving": 2}
    return min(members, key=lambda w: (order[w.state], w.load.decode_seqs + w.load.queued_requests,
                                       w.load.queued_tokens, w.worker_id)).worker_id


def _donor(role: str, obs: Observation, config: PlannerConfig, signals: dict,
           counts: dict, taken: set[str], lent: set[str]) -> tuple[str, str] | None:
    """A pool that can spare a worker to the short one, and which worker: flipping
    keeps the weights loaded, so it comes before adding one. A pool lends one a tick
    (its spare check is for one worker fewer): `lent` names those that did."""
    for other in config.roles:
        # Its spare check gives up a starting worker first: a flip takes a serving one,
        # so only a pool with none coming can lend.
        if other == role or other in lent or not signals[other].spare or signals[other].short \
                or signals[other].coming or counts[other] <= config.minimum(other) \
                or config.devices(other) != config.devices(role):  # its ranks stay its own
            continue
        serving = [w for w in obs.workers if w.role == other and w.state == "serving"
                   and w.worker_id not in taken]
        if serving:
            best = min(serving, key=lambda w: (w.load.decode_seqs + w.load.queued_requests,
                                               w.load.queued_tokens, w.worker_id))
            return other, best.worker_id
    return None


def _total_load(workers: list[WorkerView]) -> WorkerLoad:
    return WorkerLoad(queued_tokens=sum(w.load.queued_tokens for w in workers),
                      queued_requests=sum(w.load.queued_requests for w in workers),
                      decode_seqs=sum(w.load.decode_seqs for w in workers),
                      decode_context=sum(w.load.decode_context for w in workers),
                      token_budget=min(w.load.token_budget for w in workers),
                      prompt_share=max(w.load.prompt_share for w in workers))


def _spread(load: WorkerLoad, n: int) -> WorkerLoad:
    return replace(load, queued_tokens=math.ceil(load.queued_tokens / n),
                   queued_requests=math.ceil(load.queued_requests / n),
                   decode_seqs=math.ceil(load.decode_seqs / n),
                   decode_context=math.ceil(load.decode_context / n))
