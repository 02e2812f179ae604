"""What the planner reads of the traffic: requests arriving (refused ones included:
refused demand is demand) and the output of those finished, over a sliding window.
The rate is the last `recent_s` seconds' (a load that stopped reads as none within
them, where the window's mean would linger for its whole length); its trend is the
least-squares slope of the window's per-bucket arrival rates, so a rising load is
seen before the queue shows it.

A load that repeats (a daily or hourly cycle, a benchmark's sinusoid) turns before
its trend shows it: from a trough the trend reads flat while the rise is a start-up
away. So arrivals are also counted in bins over a longer history, and the lag at
which that series best matches itself (Pearson's r over the overlap, at least
`min_correlation`) is taken as its period; the traffic then carries the last
period's course from one period ago on, and the planner reads the rate ahead on it
(`Traffic.ahead`). A ramp matches itself at every lag, and its course, shifted by
how far now differs from one period ago, continues it in a straight line, as the
trend would.

It also keeps what the planner is judged on: whether each request that ended over
the last `recent_s` met its SLOs, charged to the pools that answer for it (`outcomes`:
the pool that computed its prompt for the TTFT, the one that decoded it for the TPOT;
`refused`: a request refused for want of capacity missed in the pools it lacked).
Pure: time is passed in."""
from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.router.planner.core import Traffic
from pdserve.router.slo import Slo


class TrafficWindow:
    # 30 s: a trend fitted over a longer window lags a load that turns within minutes
    # (over 60 s, a 150 s sinusoid's slope read 30 s late, past its peak still rising).
    def __init__(self, window_s: float = 30.0, buckets: int = 12, recent_s: float = 10.0,
                 bin_s: float = 5.0, history_s: float = 900.0, min_period_s: float = 30.0,
                 min_correlation: float = 0.8):
        if window_s <= 0 or buckets < 2 or not 0 < recent_s <= window_s:
            raise ValueError("window_s must be > 0, buckets >= 2, recent_s in (0, window_s]")
        if not 0 < bin_s <= recent_s or not bin_s <= min_period_s <= history_s / 2 \
                or not 0 < min_correlation <= 1:
            raise ValueError("bin_s must be in (0, recent_s], min_period_s in "
                             "[bin_s, history_s / 2], min_correlation in (0, 1]")
        self.window_s, self.buckets, self.recent_s = window_s, buckets, recent_s
        self.bin_s, self.min_correlation = bin_s, min_correlation
        self._min_lag, self._lead = round(min_period_s / bin_s), max(round(recent_s / bin_s), 1)
        self._arrivals: deque = deque()  # (time, prompt tokens)
        self._finished: deque = deque()  # (time, output tokens)
        self._judged: deque = deque()  # (time, pool role, met its SLO there)
        self._since: float | None = None  # the first arrival: a young window is shorter
        # Arrivals per bin over the history, the last bin filling (it ends at _bin_end).
        self._bins: deque[int] = deque(maxlen=max(round(history_s / bin_s), 2))
        self._bin_end = 0.0

    def arrived(self, now: float, prompt_tokens: int) -> None:
        if self._since is None:
            self._since, self._bin_end = now, now + self.bin_s
            self._bins.append(0)
        self._advance(now)
        self._bins[-1] += 1
        self._arrivals.append((now, prompt_tokens))
        _age_out(self._arrivals, now - self.window_s)  # read or not (no planner: never)

    def _advance(self, now: float) -> None:
        """Bins up to the one `now` falls in (an idle history longer than the bins
        hold starts afresh)."""
        if now - self._bin_end >= self._bins.maxlen * self.bin_s:
            self._bins.clear()
            self._bin_end += ((now - self._bin_end) // self.bin_s + 1) * self.bin_s
            self._bins.append(0)  # the bin `now` falls in
        while now >= self._bin_end:
            self._bins.append(0)
            self._bin_end += self.bin_s

    def finished(self, now: float, output_tokens: int) -> None:
        self._finished.append((now, output_tokens))
        _age_out(self._finished, now - self.window_s)

    def judged(self, now: float, outcomes: tuple[tuple[str, bool], ...]) -> None:
        """Per pool, whether a request that ended (finished, or refused for want of
        capacity) met its SLO there: `outcomes`, `refused`."""
        self._judged.extend((now, role, met) for role, met in outcomes)
        _age_out(self._judged, now - self.recent_s)

    def traffic(self, now: float) -> Traffic:
        for items in (self._arrivals, self._finished):
            _age_out(items, now - self.window_s)
        _age_out(self._judged, now - self.recent_s)
        judged = _attainment(self._judged)
        if self._since is None:
            return Traffic()
        span = min(self.window_s, max(now - self._since, self.window_s / self.buckets))
        times = np.array([t for t, _ in self._arrivals])
        recent = min(self.recent_s, max(now - self._since, self.recent_s / self.buckets))
        rate = int(np.sum(times >= now - recent)) / recent
        width = span / self.buckets
        counts = np.histogram(times, bins=self.buckets, range=(now - span, now))[0] \
            if len(times) else np.zeros(self.buckets)
        mids = now - span + width * (np.arange(self.buckets) + 0.5)
        slope = float(np.polyfit(mids - now, counts / width, 1)[0])
        isl = float(np.mean([n for _, n in self._arrivals])) if self._arrivals else 0.0
        osl = float(np.mean([n for _, n in self._finished])) if self._finished else 0.0
        self._advance(now)
        rates = np.array(list(self._bins)[:-1], dtype=np.float64) / self.bin_s  # whole bins
        lag = period(rates, self._min_lag, self._lead, self.min_correlation)
        if not lag:
            return Traffic(rate=rate, rate_slope=slope, isl=isl, osl=osl, judged=judged)
        return Traffic(rate=rate, rate_slope=slope, isl=isl, osl=osl, judged=judged,
                       echo=tuple(float(r) for r in rates[len(rates) - lag - self._lead:]),
                       echo_bin_s=self.bin_s, echo_lead=self._lead,
                       echo_age_s=now - (self._bin_end - self.bin_s))


def period(rates: np.ndarray, min_lag: int, lead: int, min_correlation: float) -> int:
    """The lag (in bins) at which the series best matches itself, over an overlap of
    at least a third of it, if r >= min_correlation there; 0: none. The course one
    lag ago needs `lead` bins before it."""
    best, best_lag = min_correlation, 0  # the smallest lag of the best r
    for lag in range(min_lag, min(2 * len(rates) // 3, len(rates) - lead) + 1):
        a, b = rates[lag:], rates[:-lag]
        if a.std() == 0.0 or b.std() == 0.0:
            continue
        r = float(np.corrcoef(a, b)[0, 1])
        if r > best or (r == best and not best_lag):
            best, best_lag = r, lag
    return best_lag


def outcomes(prompt_role: str, decode_role: str, slo: Slo, ttft_s: float,
             tpot_s: float | None) -> tuple[tuple[str, bool], ...]:
    """Per pool, whether a finished request met its SLO there: the TTFT is the pool's
    that computed its prompt, the TPOT the pool's that decoded it (tpot_s None: one
    token, nothing to judge); one pool that did both answers for both. Terms without
    a target judge nothing."""
    ttft = None if slo.ttft_s is None else ttft_s <= slo.ttft_s
    tpot = None if slo.tpot_s is None or tpot_s is None else tpot_s <= slo.tpot_s
    if prompt_role == decode_role:
        terms = [t for t in (ttft, tpot) if t is not None]
        return ((prompt_role, all(terms)),) if terms else ()
    return tuple((role, met) for role, met in ((prompt_role, ttft), (decode_role, tpot))
                 if met is not None)


def refused(kind: str, roles: set[str]) -> tuple[tuple[str, bool], ...]:
    """A request refused for want of capacity (a Reject's kind) as a miss of the pools
    present (`roles`) that lacked it: for its TTFT the pools that compute prompts, for
    its TPOT, the harm to others' or its KV the decoding pools, else every pool."""
    if kind == "ttft":
        lacking = {"prefill", "both"}
    elif kind in ("tpot", "harm", "kv"):
        lacking = {"decode", "both"}
    else:
        lacking = {"prefill", "decode", "both"}
    return tuple((role, False) for role in sorted(roles & lacking))


def _age_out(items: deque, start: float) -> None:
    """Drops what happened before `start` (items are (time, ...), oldest first)."""
    while items and items[0][0] < start:
        items.popleft()


def _attainment(judged) -> tuple[tuple[str, int, int], ...]:
    """(role, met, judged) per pool, by role."""
    counts: dict[str, list[int]] = {}
    for _, role, met in judged:
        count = counts.setdefault(role, [0, 0])
        count[0] += met
        count[1] += 1
    return tuple((role, met, total) for role, (met, total) in sorted(counts.items()))
