"""Prometheus metrics with vLLM's names (prefix `pdserve:`), one registry per router.
The router's own request counts are `pdserve:router_*`; each worker's telemetry is
exported under vLLM's per-engine names with `worker` and `role` labels."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.policy.decision import placement_kind

_RELATIVE = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY, registry=r).labels(model)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Inter-token latency",
                             labels, buckets=_LATENCY, registry=r).labels(model)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "End-to-end latency",
                             labels, buckets=_LATENCY, registry=r).labels(model)
        self.running = Gauge("pdserve:router_num_requests_running",
                             "Requests of this router past their first token", labels,
                             registry=r).labels(model)
        self.waiting = Gauge("pdserve:router_num_requests_waiting",
                             "Requests of this router before their first token", labels,
                             registry=r).labels(model)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", labels,
                                     registry=r).labels(model)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens",
                                         labels, registry=r).labels(model)
        per_worker = labels + ["worker", "role"]
        self._worker_gauges = {
            name: Gauge(f"pdserve:{metric}", doc, per_worker, registry=r)
            for name, metric, doc in (
                ("running", "num_requests_running", "Requests in the worker's batch"),
                ("waiting", "num_requests_waiting", "Requests waiting for their prefill"),
                ("waiting_tokens", "num_waiting_prompt_tokens",
                 "Prompt tokens the waiting requests still need computed"),
                ("context_tokens", "num_context_tokens",
                 "Tokens the running requests hold in KV"),
                ("reserved", "num_requests_reserved",
                 "Requests holding KV blocks while their prompt's KV arrives"),
                ("kv_usage", "kv_cache_usage_perc", "KV cache usage (1 = full)"),
                ("free_blocks", "num_free_kv_blocks", "Free KV blocks"),
                ("preemptions", "num_preemptions", "Preemptions (cumulative)"),
                ("preemptions_for_waiting", "num_preemptions_for_waiting",
                 "Preemptions the waiting timeout made: a request past its share of its "
                 "TTFT SLO admitted in a running decode's place (cumulative)"),
                ("swapped", "num_requests_swapped",
                 "Requests preempted with their KV swapped to host memory"),
                ("num_swapped_out", "num_requests_swapped_out",
                 "Preemptions that swapped the request's KV out (cumulative)"),
                ("num_swapped_in", "num_requests_swapped_in",
                 "Swapped requests resumed (cumulative)"),
                ("num_blocks_swapped_out", "num_blocks_swapped_out",
                 "KV blocks copied to the host swap area (cumulative)"),
                ("num_blocks_swapped_in", "num_blocks_swapped_in",
                 "KV blocks copied back from the host swap area (cumulative)"),
                ("cpu_usage", "cpu_cache_usage_perc",
                 "Host KV memory usage, swap area and prefix tier (1 = full)"),
                ("host_prefix_cache_hits", "cpu_prefix_cache_hits",
                 "Prompt tokens served from the host prefix tier (cumulative)"),
                ("host_blocks_stored", "cpu_prefix_cache_blocks_stored",
                 "KV blocks written into the host prefix tier (cumulative)"),
                ("host_blocks_evicted", "cpu_prefix_cache_blocks_evicted",
                 "KV blocks dropped from the host prefix tier for room (cumulative)"),
                ("host_blocks_loaded", "cpu_prefix_cache_blocks_loaded",
                 "KV blocks loaded back from the host prefix tier (cumulative)"),
            )}
        self._step_seconds = Histogram("pdserve:step_duration_seconds",
                                       "Engine step duration (forward pass included)",
                                       per_worker, buckets=_LATENCY, registry=r)
        self._prefix_events = Counter("pdserve:prefix_cache_block_events",
                                      "Prefix-cache blocks made findable / evicted",
                                      per_worker + ["event"], registry=r)
        # Speculative decoding under vLLM's names: counters fed by the workers'
        # cumulative figures (a restarted worker's start again from zero).
        self._spec = {name: Counter(f"pdserve:spec_decode_{name}", doc, per_worker, registry=r)
                      for name, doc in (
                          ("num_drafts", "Verification steps of one request"),
                          ("num_draft_tokens", "Draft tokens verified"),
                          ("num_accepted_tokens", "Draft tokens accepted"))}
        self._spec_per_pos = Counter("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by their position in the draft",
                                     per_worker + ["position"], registry=r)
        self._roles: dict[str, str] = {}  # worker -> the role its series carry
        self._series: dict[str, dict] = {}  # worker -> its labelled series
        self.lease_expiries = Gauge(
            "pdserve:kv_lease_expiries",
            "Decode-side KV released by a lease (cumulative): a reservation never begun, "
            "a transfer past its deadline, landed KV never started",
            labels + ["lease"], registry=r)
        self.requests = Counter("pdserve:request_success", "Finished requests",
                                labels + ["finished_reason"], registry=r)
        self.decisions = Counter("pdserve:router_decisions",
                                 "Placement decisions by kind (colocate, disaggregate, "
                                 "reject) and, for rejections, why",
                                 labels + ["kind", "reason"], registry=r)
        self.waited = Counter("pdserve:router_placement_waits",
                              "Times a request waited for capacity instead of a 429 "
                              "(its TTFT SLO left time)", labels, registry=r).labels(model)
        self.waiters = Counter("pdserve:router_placement_waiters",
                               "Requests that waited for capacity, by how the wait ended "
                               "(placed, or refused once the time ran out)",
                               labels + ["outcome"], registry=r)
        self.wait_seconds = Histogram(
            "pdserve:router_placement_wait_seconds",
            "How long requests waited for capacity, by how the wait ended (placed, or "
            "refused: the 429 came that much later than at once)",
            labels + ["outcome"], buckets=_LATENCY, registry=r)
        self.prefix_tokens = Counter(
            "pdserve:router_prefix_hit_tokens",
            "Prompt tokens of placed requests held in a prefix cache (by the prefix index): "
            "on the worker chosen to compute the prompt (placed), and on the worker "
            "holding the most (best)", labels + ["where"], registry=r)
        self.prediction_error = Histogram(
            "pdserve:router_prediction_relative_error",
            "|predicted - measured| / measured of each request's TTFT and TPOT, by the "
            "placement's kind (colocate | disaggregate) and whether the forecast was "
            "under or over the measurement", labels + ["metric", "kind", "direction"],
            buckets=_RELATIVE, registry=r)
        self.slo_requests = Counter("pdserve:router_slo_requests",
                                    "Finished requests with an SLO, by whether they met it "
                                    "and the placement's kind (colocate | disaggregate)",
                                    labels + ["slo", "met", "kind"], registry=r)
        self.goodput = Counter("pdserve:router_goodput_requests",
                               "Finished requests that set an SLO, by whether they met every "
                               "SLO they set (met=true: goodput) and the placement's kind",
                               labels + ["met", "kind"], registry=r)
        self.migrations = Counter(
            "pdserve:router_migrations",
            "Requests moved off a failed worker and placed again as prompt plus the tokens "
            "generated so far, by why (worker_died, worker_stalled, worker_error: a KV "
            "transfer or call that failed) and the request's phase then (prefill: no "
            "token streamed yet; decode)", labels + ["reason", "phase"], registry=r)
        self.live_moves = Counter(
            "pdserve:router_live_migrations",
            "Running requests a drain moved to another worker with their KV, by outcome "
            "(moved; gave_up: it decodes on where it was; replayed: a step failed after "
            "its pause, so it was placed again)", labels + ["outcome"], registry=r)
        self.migration_pause = Histogram(
            "pdserve:router_migration_pause_seconds",
            "How long a request moved live stopped decoding, as far as the router sees: "
            "from its pause asked to its last copy landed on the target", labels, buckets=_LATENCY,
            registry=r).labels(model)
        self.planner_decisions = Counter(
            "pdserve:planner_decisions", "The SLO planner's actions: add, remove, flip (to "
            "the role named), by cause (minimum, maximum, miss, demand, spare)",
            labels + ["action", "role", "reason"], registry=r)
        self.planner_desired = Gauge("pdserve:planner_desired_workers",
                                     "Workers the SLO planner wants in each pool",
                                     labels + ["role"], registry=r)
        self.pool_workers = Gauge("pdserve:pool_workers",
                                  "Workers by role and state (serving, draining, stalled, "
                                  "restarting, dead, pending, starting)",
                                  labels + ["role", "state"], registry=r)
        self._model = self.model_name = model

    def observe_worker(self, t) -> None:
        """One WorkerTelemetry report."""
        if self._roles.get(t.worker_id, t.role) != t.role:
            self.forget_worker(t.worker_id)  # its series under the old role end
        series = self._series.get(t.worker_id)
        if series is None:  # looked up once per worker: a report comes every step
            self._roles[t.worker_id] = t.role
            key = (self._model, t.worker_id, t.role)
            series = self._series[t.worker_id] = {
                **{name: gauge.labels(*key) for name, gauge in self._worker_gauges.items()},
                "steps": self._step_seconds.labels(*key),
                "stored": self._prefix_events.labels(*key, "stored"),
                "evicted": self._prefix_events.labels(*key, "evicted")}
        for name in ("running", "waiting", "waiting_tokens", "context_tokens", "reserved",
                     "free_blocks"):
            series[name].set(getattr(t, name))
        series["kv_usage"].set(1 - t.free_blocks / t.num_blocks if t.num_blocks else 0)
        series["preemptions"].set(t.num_preemptions)
        series["preemptions_for_waiting"].set(t.num_preemptions_for_waiting)
        for name in ("swapped", "num_swapped_out", "num_swapped_in", "num_blocks_swapped_out",
                     "num_blocks_swapped_in", "host_prefix_cache_hits", "host_blocks_stored",
                     "host_blocks_evicted", "host_blocks_loaded"):
            series[name].set(getattr(t, name))
        series["cpu_usage"].set(t.host_used_blocks / t.host_num_blocks
                                if t.host_num_blocks else 0)
        for step in t.steps:
            series["steps"].observe(step.duration_s)
        if t.prefix_stored:
            series["stored"].inc(len(t.prefix_stored))
        if t.prefix_evicted:
            series["evicted"].inc(len(t.prefix_evicted))
        if t.spec_num_drafts:
            self._observe_spec(t, series)

    def _observe_spec(self, t, series: dict) -> None:
        """The growth of a worker's cumulative speculative-decoding figures."""
        last = series.setdefault("spec_last", {})
        children = series.setdefault("spec_children", {})  # labelled once per worker
        key = (self._model, t.worker_id, t.role)
        figures = {"num_drafts": t.spec_num_drafts, "num_draft_tokens": t.spec_num_draft_tokens,
                   "num_accepted_tokens": t.spec_num_accepted_tokens,
                   **{i: v for i, v in enumerate(t.spec_accepted_per_pos)}}
        restarted = t.spec_num_drafts < last.get("num_drafts", 0)  # counting from 0 again
        for name, value in figures.items():
            grown = value if restarted else value - last.get(name, 0)
            last[name] = value
            if grown:
                counter = children.get(name)
                if counter is None:
                    counter = children[name] = (
                        self._spec[name].labels(*key) if isinstance(name, str)
                        else self._spec_per_pos.labels(*key, str(name)))
                counter.inc(grown)

    def forget_worker(self, worker_id: str) -> None:
        """A worker that left (or changed role): its series end."""
        role = self._roles.pop(worker_id, None)
        series = self._series.pop(worker_id, None) or {}
        if role is None:
            return
        key = (self._model, worker_id, role)
        for metric in [*self._worker_gauges.values(), self._step_seconds, *self._spec.values()]:
            try:
                metric.remove(*key)
            except KeyError:
                pass
        for position in (p for p in series.get("spec_last", {}) if isinstance(p, int)):
            self._spec_per_pos.remove(*key, str(position))
        for event in ("stored", "evicted"):
            try:
                self._prefix_events.remove(*key, event)
            except KeyError:
                pass

    def decided(self, decision) -> None:
        kind = type(decision).__name__.lower()
        self.decisions.labels(self._model, kind, getattr(decision, "kind", "")).inc()

    def waited_out(self, outcome: str, seconds: float) -> None:
        """A request that waited `seconds` for capacity was placed, or refused."""
        self.waiters.labels(self._model, outcome).inc()
        self.wait_seconds.labels(self._model, outcome).observe(seconds)

    def placed_prefix(self, placed: int, best: int) -> None:
        """A placed request's prompt tokens cached where it is computed, and the most
        any worker holds."""
        self.prefix_tokens.labels(self._model, "placed").inc(placed)
        self.prefix_tokens.labels(self._model, "best").inc(best)

    def judged(self, slo, decision, ttft_s: float, tpot_s: float | None,
               waited_s: float = 0.0) -> None:
        """A finished request: its SLO attainment, and its forecast's error. Both TTFTs
        count from its arrival; the error is of the part from its placement, after
        it waited `waited_s` for capacity (a known wait is no forecast)."""
        kind = placement_kind(decision)
        judged, met_all = False, True
        for name, target, measured, known in (("ttft", slo.ttft_s, ttft_s, waited_s),
                                              ("tpot", slo.tpot_s, tpot_s, 0.0)):
            predicted = getattr(decision, f"{name}_s", None)
            if measured is None:
                continue
            if predicted is not None and measured - known > 0:
                self.prediction_error.labels(
                    self._model, name, kind, "under" if predicted < measured else "over",
                ).observe(abs(predicted - measured) / (measured - known))
            if target is not None:
                met = measured <= target
                judged, met_all = True, met_all and met
                self.slo_requests.labels(self._model, name, str(met).lower(), kind).inc()
        if judged:
            self.goodput.labels(self._model, str(met_all).lower(), kind).inc()

    def count_workers(self, census: dict[tuple[str, str], int]) -> None:
        """The pools by (role, state), every pair shown (0 when none)."""
        for role in ("prefill", "decode", "both"):
            for state in ("serving", "draining", "stalled", "restarting", "dead", "pending",
                          "starting"):
                self.pool_workers.labels(self._model, role, state).set(
                    census.get((role, state), 0))

    def finished(self, reason: str) -> None:
        self.requests.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
