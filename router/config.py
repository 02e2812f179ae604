"""Router settings, frozen and validated where built."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.options import bounds_of, bounds_text, option, within
from pdserve.router.planner.core import PlannerConfig
from pdserve.router.slo import Slo

MODES = ("disaggregated", "colocated", "adaptive")
POLICIES = ("goodput", "least-loaded", "round-robin")  # router/policy/decide.py maps each to its decide
ADMISSIONS = ("slo", "always")


@dataclass(frozen=True)
class RoutingSpec:
    """How the router places requests (`pdserve serve` flags)."""
    routing_policy: str = option("goodput", "goodput: forecast TTFT and TPOT of every "
                                 "placement and pick the cheapest that meets the SLOs; "
                                 "least-loaded; round-robin", choices=POLICIES)
    admission: str = option("slo", "slo: refuse (429 + Retry-After) a request no placement "
                            "would serve within its SLOs, or that would push running "
                            "requests past theirs; always: place every request",
                            choices=ADMISSIONS)
    prefix_aware: bool = option(True, "goodput: count the prompt tokens each worker's "
                                "prefix cache holds (from the workers' telemetry) as "
                                "computed")
    calibrate: bool = option(True, "goodput: scale each worker's forecasts by how far "
                             "they ran from what its finished requests measured (per "
                             "TTFT and TPOT, colocated and split)")
    ttft_headroom: float = option(0.9, "goodput: place a request only where its forecast "
                                  "TTFT is within this share of its TTFT SLO (1: the SLO "
                                  "itself): one placed at the forecast's edge misses about as "
                                  "often as not, and lengthens the queue of every request "
                                  "placed behind it", gt=0, le=1)
    max_wait_ms: float | None = option(None, "admission slo: the longest a request refused "
                                       "for want of capacity (KV, or headroom under the "
                                       "running requests' TPOT SLOs) waits for some to "
                                       "free before its 429; unset: while its TTFT SLO "
                                       "leaves time; 0: never waits")
    migration_limit: int = option(3, "times a request may move to another worker when "
                                  "the one holding it dies, stalls or fails its KV "
                                  "transfer: it is placed again as its prompt plus the "
                                  "tokens generated so far and its stream goes on; 0: it "
                                  "fails with the worker", ge=0)
    live_migration: bool = option(True, "a drain (admin, the planner's scale-down, a role "
                                  "change) moves running requests to other workers with "
                                  "their KV while they decode, each paused only for a last "
                                  "copy, rather than waiting for them to end")
    slo_ttft_ms: float | None = option(None, "TTFT SLO of requests that set none "
                                       "(x-slo-ttft-ms, slo_ttft_ms); unset: best effort")
    slo_tpot_ms: float | None = option(None, "TPOT SLO of requests that set none "
                                       "(x-slo-tpot-ms, slo_tpot_ms); unset: best effort")

    def __post_init__(self) -> None:
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {POLICIES}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}")
        if not 0 < self.ttft_headroom <= 1:
            raise ValueError(f"ttft_headroom must be in (0, 1], got {self.ttft_headroom}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_wait_ms is not None and not 0 <= self.max_wait_ms < float("inf"):
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {self.max_wait_ms}")
        self.default_slo  # checked

    @property
    def max_wait_s(self) -> float:
        return float("inf") if self.max_wait_ms is None else self.max_wait_ms / 1e3

    @property
    def default_slo(self) -> Slo:
        try:
            return Slo.from_ms(self.slo_ttft_ms, self.slo_tpot_ms)
        except InvalidRequestError as err:
            raise ValueError(str(err)) from None


@dataclass(frozen=True)
class AutoscaleSpec:
    """The SLO planner (`pdserve serve --autoscale` flags): each pool sized against
    the SLOs the server routes with (router/planner/core.py)."""
    autoscale: bool = option(False, "run the SLO planner: it adds, drains, removes and "
                             "flips workers to keep TTFT and TPOT within the SLOs "
                             "(--slo-ttft-ms, --slo-tpot-ms) at the fewest workers")
    min_prefill_workers: int = option(1, "--autoscale: the prefill pool's floor", ge=0)
    max_prefill_workers: int = option(4, "--autoscale: the prefill pool's ceiling", ge=0)
    min_decode_workers: int = option(1, "--autoscale: the decode pool's floor (colocated "
                                     "mode: the pool of role both)", ge=0)
    max_decode_workers: int = option(4, "--autoscale: the decode pool's ceiling "
                                     "(colocated mode: the pool of role both)", ge=0)
    max_workers: int = option(8, "--autoscale: the budget, every pool together", ge=1)
    max_devices: int = option(0, "--autoscale: the budget in devices (a worker of "
                              "tensor_parallel_size N holds N), every pool together; 0: "
                              "none beyond --max-workers", ge=0)
    planner_interval_s: float = option(5.0, "--autoscale: seconds between the planner's "
                                       "decisions", gt=0)
    planner_down_ticks: int = option(
        PlannerConfig.down_sustain, "--autoscale: decisions in a row a pool must be able "
        "to spare a worker (its load re-forecast at one fewer within the margin) before "
        "one is removed", ge=1)
    planner_reversal_guard_s: float = option(
        PlannerConfig.reversal_guard_s, "--autoscale: seconds after a pool's new worker "
        "would serve (a start-up after it was asked for) before the pool may shrink", ge=0)
    planner_load_factor: float = option(
        PlannerConfig.load_factor, "--autoscale: how many times the load the latency "
        "model gives a worker within the SLOs it is counted on for: above 1 the pools are "
        "sized to miss at the peaks (spending the misses an attainment goal allows) "
        "at fewer workers; below 1, headroom", gt=0)

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}_workers"), getattr(self, f"max_{role}_workers")
            if not 0 <= low <= high:
                raise ValueError(f"--min-{role}-workers {low} and --max-{role}-workers {high}: "
                                 "need 0 <= min <= max")
        if self.min_prefill_workers + self.min_decode_workers > self.max_workers:
            raise ValueError(f"--max-workers {self.max_workers} is below the pools' minima "
                             f"({self.min_prefill_workers} + {self.min_decode_workers})")
        if not self.planner_interval_s > 0:
            raise ValueError("--planner-interval-s must be > 0")
        if self.planner_down_ticks < 1:
            raise ValueError("--planner-down-ticks must be >= 1")
        if not self.planner_reversal_guard_s >= 0:
            raise ValueError("--planner-reversal-guard-s must be >= 0")
        if not self.planner_load_factor > 0:
            raise ValueError("--planner-load-factor must be > 0")
        for roles in (("prefill", "decode"), ("both",)):
            self.planner_config(roles)  # and the planner's own checks

    def planner_config(self, roles: tuple[str, ...],
                       devices: dict[str, int] | None = None) -> PlannerConfig:
        """For the pools of these roles: prefill and decode, or both (colocated).
        devices: each pool's devices per worker (its tensor_parallel_size)."""
        colocated = roles == ("both",)
        minima = (("both", self.min_decode_workers),) if colocated else (
            ("prefill", self.min_prefill_workers), ("decode", self.min_decode_workers))
        maxima = (("both", self.max_decode_workers),) if colocated else (
            ("prefill", self.max_prefill_workers), ("decode", self.max_decode_workers))
        return PlannerConfig(roles=roles, min_workers=minima, max_workers_per_pool=maxima,
                             max_workers=self.max_workers,
                             devices_per_worker=tuple(sorted((devices or {}).items())),
                             max_devices=self.max_devices,
                             interval_s=self.planner_interval_s,
                             down_sustain=self.planner_down_ticks,
                             reversal_guard_s=self.planner_reversal_guard_s,
                             load_factor=self.planner_load_factor)


REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class SharedStateSpec:
    """State router replicas share in Redis (`--redis-url`; docs/replicas.md). Unset,
    every piece of it stays in this process."""
    redis_url: str = option("", "share state with the other router replicas through this "
                            "Redis (a duplicate request id is refused by every replica; an "
                            "abort sent to any replica reaches the one streaming the "
                            "request; one replica's planner acts): "
                            "redis://[:password@]host:port/db, rediss:// (TLS) or "
                            "unix:///path; default: $PDSERVE_REDIS_URL (keeps a password "
                            "off the command line), else this router alone")
    redis_prefix: str = option("pdserve", "--redis-url: every key of this cluster starts "
                               "with it (one Redis can serve several clusters)")
    redis_timeout_s: float = option(0.5, "--redis-url: the longest one Redis call may "
                                    "take; past it the router goes on with its own view",
                                    gt=0)
    request_ttl_s: float = option(30.0, "--redis-url: a request's ownership entry lives "
                                  "this long unless renewed (every third of it, while the "
                                  "request runs): a dead replica's entries go by then", gt=0)
    leader_ttl_s: float = option(10.0, "--redis-url: one replica's planner acts (with "
                                 "--autoscale); its lease lasts this long unless renewed, "
                                 "so another takes over within it when the leader dies",
                                 gt=0)
    registry_ttl_s: float = option(30.0, "--redis-url: the pool registry (the pool, its "
                                   "workers, the live replicas) lives this long unless a "
                                   "replica renews it (every third of it); a replica not "
                                   "renewing for this long counts as gone", gt=0)

    def __post_init__(self) -> None:
        if self.redis_url:
            scheme = self.redis_url.partition("://")[0]
            if scheme not in REDIS_SCHEMES or "://" not in self.redis_url:
                raise ValueError(f"--redis-url must start with one of "
                                 f"{', '.join(s + '://' for s in REDIS_SCHEMES)}")
            from redis.connection import parse_url
            try:
                parse_url(self.redis_url)  # before any worker loads
            except ValueError as err:
                raise ValueError(f"--redis-url: {err}") from None
        if not self.redis_prefix or any(c.isspace() for c in self.redis_prefix):
            raise ValueError("--redis-prefix must be a non-empty word")
        for name in ("redis_timeout_s", "request_ttl_s", "leader_ttl_s", "registry_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")


STRATEGIES = ("default", "spread")  # Ray's scheduling strategies, as for actors


@dataclass(frozen=True)
class RouterConfig:
    """The router's timeouts and limits (`pdserve serve` and `pdserve router` flags,
    `--reserve-timeout-s` and on), and the specs beside it."""
    reserve_timeout_s: float = option(10.0, "seconds a decode worker may take to reserve "
                                      "a request's KV blocks", gt=0)
    prefill_timeout_s: float = option(120.0, "seconds a prefill may take, its KV transfer "
                                      "included", gt=0)
    start_timeout_s: float = option(30.0, "seconds a decode worker may take to start a "
                                    "request whose KV landed", gt=0)
    control_timeout_s: float = option(5.0, "seconds an abort or a stats call to a worker "
                                      "may take", gt=0)
    startup_timeout_s: float = option(600.0, "seconds the workers may take to be placed, "
                                      "load and pair at launch", gt=0)
    placement_timeout_s: float = option(300.0, "a worker added at run time that Ray has "
                                        "not placed within this many seconds is abandoned, "
                                        "its reason shown (`pdserve admin list`) and logged "
                                        "(an autoscaler may need minutes for a node); once "
                                        "placed it has --startup-timeout-s to load", gt=0)
    revive_timeout_s: float = option(600.0, "seconds a worker whose process died is waited "
                                     "for while Ray restarts it (model loading included), "
                                     "before it is given up", gt=0)
    migration_wait_s: float = option(30.0, "seconds a request moving off a failed worker "
                                     "(--migration-limit) that no other can take waits for "
                                     "one (a dead worker's restart, say)", gt=0)
    stall_timeout_s: float = option(30.0, "a decode worker that sends neither a step nor a "
                                    "heartbeat for this many seconds fails every request it "
                                    "holds (they move, or fail)", gt=0)
    telemetry_stale_s: float = option(5.0, "a worker's telemetry older than this many "
                                      "seconds counts as unknown (it reports every step and "
                                      "at least twice a second while idle); /health says so",
                                      gt=0)
    worker_drain_timeout_s: float = option(300.0, "seconds a worker's drain (admin drain, "
                                           "role change or removal) waits for its requests "
                                           "to finish", gt=0)
    retry_after_s: float = option(1.0, "the Retry-After told to clients on overload, "
                                  "seconds", gt=0)
    max_inflight: int = option(0, "requests the router holds at once, past which it "
                               "answers 429; 0: no cap", ge=0)
    max_queued_prefill_tokens: int = option(32768, "prompt tokens admitted to one prefill "
                                            "worker and not yet prefilled; past it a "
                                            "request gets 429 at once instead of a wait "
                                            "that could outlast its lease; 0: unbounded",
                                            ge=0)
    max_request_bytes: int = option(4 << 20, "an HTTP body or gRPC message larger than "
                                    "this is refused (413 / RESOURCE_EXHAUSTED) before it "
                                    "is parsed (a 128k-token prompt is about 1 MiB as JSON)",
                                    ge=1)
    routing: RoutingSpec = RoutingSpec()
    autoscale: AutoscaleSpec = AutoscaleSpec()
    shared: SharedStateSpec = SharedStateSpec()
    # Workers in role both may also be paired, prefill on one and decode on another
    # (the adaptive mode; launch sets it).
    adaptive: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            bounds = bounds_of(f)
            if bounds and not within(getattr(self, f.name), bounds):
                raise ValueError(f"--{f.name.replace('_', '-')} must be "
                                 f"{bounds_text(bounds)}, got {getattr(self, f.name)}")

    @classmethod
    def flags(cls) -> tuple[str, ...]:
        """The fields that are flags: its own, not the specs beside them."""
        return tuple(f.name for f in fields(cls) if f.name not in _NOT_FLAGS)


_NOT_FLAGS = ("routing", "autoscale", "shared", "adaptive")


@dataclass(frozen=True)
class PoolSpec:
    prefill_workers: int = option(1, "prefill workers (colocated: engine workers too)")
    decode_workers: int = option(1, "decode workers (colocated: engine workers too)")
    mode: str = option("disaggregated", "disaggregated: prefill and decode pools; "
                       "colocated: every worker runs whole requests; adaptive: every "
                       "worker may run whole requests, prefill for another or decode "
                       "for another, as the routing policy chooses per request",
                       choices=MODES)
    num_cpus_per_worker: float = option(1.0, "Ray CPUs per worker actor (per rank of a "
                                        "tensor-parallel worker)")
    num_gpus_per_worker: float = option(0.0, "Ray GPUs per worker actor (1 on GPU machines; "
                                        "per rank of a tensor-parallel worker)")
    max_restarts: int = option(-1, "times Ray restarts a worker whose process died "
                               "(-1: always, 0: never)")
    prefill_resources: str = option("", "custom Ray resources a prefill worker needs, as "
                                    "JSON (e.g. '{\"prefill_node\": 1}'): pins it to nodes "
                                    "that offer them")
    decode_resources: str = option("", "custom Ray resources a decode (colocated: engine) "
                                   "worker needs, as JSON")
    placement: str = option("default", "Ray scheduling strategy for the workers: default "
                            "(pack) or spread (across nodes)", choices=STRATEGIES)
    prefill_tensor_parallel_size: int = option(
        0, "ranks (devices) per prefill worker, on one node (0: --tensor-parallel-size)",
        ge=0)
    decode_tensor_parallel_size: int = option(
        0, "ranks (devices) per decode (colocated: engine) worker, on one node (0: "
        "--tensor-parallel-size)", ge=0)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.mode == "disaggregated" and (self.prefill_workers < 1 or self.decode_workers < 1):
            raise ValueError("disaggregated mode needs at least one prefill and one decode worker")
        if self.prefill_workers < 0 or self.decode_workers < 0 or self.num_engine < 1:
            raise ValueError("colocated mode needs at least one engine worker")
        if self.max_restarts < -1:
            raise ValueError("max_restarts must be >= -1")
        if self.placement not in STRATEGIES:
            raise ValueError(f"placement must be one of {STRATEGIES}")
        for role in ("prefill", "decode"):
            self.resources(role)
        if self.mode == "adaptive" and self.prefill_tensor_parallel_size \
                and self.decode_tensor_parallel_size \
                and self.prefill_tensor_parallel_size != self.decode_tensor_parallel_size:
            raise ValueError("adaptive mode runs every worker in every role: "
                             "--prefill-tensor-parallel-size and "
                             "--decode-tensor-parallel-size must be equal")

    def tensor_parallel_size(self, role: str, default: int) -> int:
        """The ranks of a worker of `role` (decode for decode and both)."""
        size = self.prefill_tensor_parallel_size if role == "prefill" \
            else self.decode_tensor_parallel_size
        return size or default

    def resources(self, role: str) -> dict[str, float]:
        """The custom resources a worker of `role` needs (decode for decode and both)."""
        name = "prefill_resources" if role == "prefill" else "decode_resources"
        text = getattr(self, name)
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not JSON: {exc.msg}") from None
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v > 0 for k, v in value.items()):
            raise ValueError(f"{name} must be a JSON object of resource name -> amount > 0")
        if {"CPU", "GPU", "memory"} & value.keys():
            raise ValueError(f"{name}: set CPU and GPU with num_cpus_per_worker / "
                             "num_gpus_per_worker")
        return {k: float(v) for k, v in value.items()}

    @property
    def roles(self) -> list[str]:
        """The role of each worker to launch, in order."""
        if self.mode != "disaggregated":
            return ["both"] * self.num_engine
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers

    @property
    def num_engine(self) -> int:
        """Decode workers, or (colocated, adaptive) every engine worker."""
        if self.mode == "disaggregated":
            return self.decode_workers
        return self.prefill_workers + self.decode_workers


@dataclass(frozen=True)
class TLSConfig:
    """The front ends serve HTTPS and gRPC over TLS from these PEM files."""
    certfile: str
    keyfile: str

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile"):
            if not Path(getattr(self, name)).is_file():
                raise ValueError(f"{name} {getattr(self, name)!r} is not a file")

    def grpc_credentials(self):
        import grpc
        return grpc.ssl_server_credentials(
            [(Path(self.keyfile).read_bytes(), Path(self.certfile).read_bytes())])
