"""Prometheus metrics with vLLM's names (prefix `pdserve:`), one registry per router."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.running = Gauge("pdserve:num_requests_running", "Requests decoding",
                             labels, registry=r).labels(model)
        self.waiting = Gauge("pdserve:num_requests_waiting",
                             "Requests accepted and not yet decoding", labels,
                             registry=r).labels(model)
        self.kv_usage = Gauge("pdserve:kv_cache_usage_perc",
                              "Decode KV cache usage (1 = full)", labels, registry=r).labels(model)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", labels,
                                     registry=r).labels(model)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens",
                                         labels, registry=r).labels(model)
        self.preemptions = Gauge("pdserve:num_preemptions",
                                 "Preemptions on the decode workers (cumulative)", labels,
                                 registry=r).labels(model)
        self.lease_expiries = Gauge(
            "pdserve:kv_lease_expiries",
            "Decode-side KV released by a lease (cumulative): a reservation never begun, "
            "a transfer past its deadline, landed KV never started",
            labels + ["lease"], registry=r)
        self.requests = Counter("pdserve:request_success", "Finished requests",
                                labels + ["finished_reason"], registry=r)
        self._model = model

    def finished(self, reason: str) -> None:
        self.requests.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
