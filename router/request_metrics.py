"""One request's metrics as it streams: waiting until its first token, then running;
at its end its SLO attainment and how far its latencies were from the forecast."""
from __future__ import annotations

from typing import Callable

from pdserve.router.clock import Clock
from pdserve.router.lifecycle import Flight
from pdserve.router.metrics import RouterMetrics
from pdserve.worker.messages import TokenDelta


class RequestTracker:
    def __init__(self, metrics: RouterMetrics, flight: Flight, clock: Clock,
                 on_measured: Callable[[Flight, float, float | None], None]):
        """on_measured(flight, ttft, tpot) at its end (tpot None: one token). A choice
        of an n > 1 request (flight.index > 0) counts its tokens alone: the request is
        measured by its leader."""
        self.m, self.flight, self.req, self.clock = metrics, flight, flight.req, clock
        self.on_measured = on_measured
        self.waiting = True
        self.last = flight.req.arrival_time
        self.closed = flight.index > 0
        if not self.closed:
            metrics.waiting.inc()

    def observe(self, delta: TokenDelta) -> TokenDelta:
        now, m = self.clock.time(), self.m
        if self.flight.index:
            m.generation_tokens.inc(len(delta.token_ids))
            return delta
        if delta.token_ids:
            if self.waiting:
                self.waiting = False
                m.waiting.dec()
                m.running.inc()
                m.ttft.observe(now - self.req.arrival_time)
            else:
                m.itl.observe((now - self.last) / len(delta.token_ids))
            self.last = now
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finished:
            m.e2e.observe(now - self.req.arrival_time)
            m.finished(delta.finish_reason or "stop")
            self._judge(now)
        return delta

    def _judge(self, now: float) -> None:
        flight = self.flight
        if flight.first_token_at is None:
            return
        ttft = flight.first_token_at - self.req.arrival_time
        n = flight.num_output_tokens
        tpot = (now - flight.first_token_at) / (n - 1) if n > 1 else None
        self.m.judged(self.req.slo, flight.predicted, ttft, tpot,
                      waited_s=max((flight.placed_at or self.req.arrival_time)
                                   - self.req.arrival_time, 0.0))
        self.on_measured(flight, ttft, tpot)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            (self.m.waiting if self.waiting else self.m.running).dec()
