"""In-flight load per worker, shared between router replicas (`--redis-url`).

A worker reports its load with every step, but between two reports each replica
knows only the requests it sent itself: replicas that each see a worker as the least
loaded would all send it their next requests. So each replica shares its own counts
per worker (prompts queued there and their tokens, requests reserved or running
there) and adds the others' to its view (`WorkerState.others_*`), which the policies
read as every replica's (`all_queued`, `all_inflight`, `reported_load`). Each
replica's share is kept apart and summed, never overwritten by another's view.

`LocalLoad` is the embedded default (one router: its counts are all there is);
`RedisLoad` publishes on `P:load` (channel): "<replica id>\\n<json {worker id:
[queued, queued tokens, in flight]}>", what changed at most every PUBLISH_S, and all
of its counts every FULL_S (a replica that starts later, or missed a message, has
them within that). A replica not heard from for STALE_S counts no more (it died, or
Redis is away: each goes on with its own counts and the workers' reports)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Mapping, Protocol

from redis.exceptions import RedisError

from pdserve.router.replicas.redis_client import Reachability, listen, stopping

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from pdserve.router.config import SharedStateSpec
    from pdserve.router.pool.workers import WorkerHandle

log = logging.getLogger(__name__)

PUBLISH_S = 0.02  # changes go out at most this often (one publish for all of them)
FULL_S = 1.0  # every count, this often
STALE_S = 3.0  # a replica silent this long counts no more

Counts = tuple[int, int, int]  # queued, queued tokens, in flight
_ZERO: Counts = (0, 0, 0)


class LoadBoard(Protocol):
    async def start(self, workers: Mapping[str, WorkerHandle]) -> None:
        """Shares this router's counts on `workers` (the pool's members, read live)
        and adds the other replicas' to their states."""

    async def stop(self) -> None: ...


class LocalLoad:
    """One router alone: nothing to share."""

    async def start(self, workers: Mapping[str, WorkerHandle]) -> None:
        pass

    async def stop(self) -> None:
        pass


class RedisLoad:
    def __init__(self, client: Redis, prefix: str, replica_id: str,
                 backoff_s: tuple[float, float] = (0.05, 5.0)):
        if "\n" in replica_id:
            raise ValueError("a replica id is one line")
        self.client, self.replica_id, self.backoff_s = client, replica_id, backoff_s
        self.channel = f"{prefix}:load"
        self.workers: Mapping[str, WorkerHandle] = {}
        self._sent: dict[str, Counts] = {}  # what the others last heard of ours
        self._others: dict[str, dict[str, Counts]] = {}  # replica -> worker -> its counts
        self._heard_at: dict[str, float] = {}  # replica -> monotonic, its last message
        self._tasks: list[asyncio.Task] = []
        self.listening = asyncio.Event()
        self.redis = Reachability("the workers' load")
        self.published = 0  # messages sent

    async def start(self, workers: Mapping[str, WorkerHandle]) -> None:
        self.workers = workers
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publishing()),
                       loop.create_task(listen(self.client, self.channel, self._heard,
                                               self._up, self._down, self.backoff_s,
                                               "shared load"))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    # ---- this replica's counts --------------------------------------------------------

    def _counts(self) -> dict[str, Counts]:
        return {worker_id: (w.state.queued, w.state.queued_tokens, w.state.inflight)
                for worker_id, w in self.workers.items()}

    async def _publishing(self) -> None:
        full_at = 0.0
        while not stopping():
            await asyncio.sleep(PUBLISH_S)  # the publishing period
            now = time.monotonic()
            counts = self._counts()
            full = now - full_at >= FULL_S
            if full:
                changed = {w: c for w, c in counts.items() if c != _ZERO}
            else:  # gone workers count zero
                changed = {w: counts.get(w, _ZERO) for w in counts.keys() | self._sent.keys()
                           if counts.get(w, _ZERO) != self._sent.get(w, _ZERO)}
                if not changed:
                    self._forget_silent(now)
                    continue
            try:
                await self.client.publish(self.channel, f"{self.replica_id}\n"
                                          f"{'F' if full else 'D'}\n{json.dumps(changed)}")
            except RedisError as err:
                self.redis.lost("share the load", err)
            else:
                self.redis.reached()
                self.published += 1
                self._sent = {w: c for w, c in counts.items() if c != _ZERO}
                if full:
                    full_at = now
            self._forget_silent(now)

    # ---- the others' -------------------------------------------------------------------

    def _heard(self, data: str) -> None:
        replica_id, kind, text = data.split("\n", 2)
        if replica_id == self.replica_id:
            return
        counts = {w: tuple(c) for w, c in json.loads(text).items()}
        theirs = self._others.setdefault(replica_id, {})
        touched = set(counts)
        if kind == "F":  # all of them: what it no longer names is zero
            touched |= set(theirs)
            theirs.clear()
        theirs.update({w: c for w, c in counts.items() if c != _ZERO})
        for w in [w for w, c in counts.items() if c == _ZERO]:
            theirs.pop(w, None)
        self._heard_at[replica_id] = time.monotonic()
        self._apply(touched)

    def _forget_silent(self, now: float) -> None:
        for replica_id in [r for r, at in self._heard_at.items() if now - at > STALE_S]:
            del self._heard_at[replica_id]
            self._apply(set(self._others.pop(replica_id, {})))

    def _apply(self, worker_ids: set[str]) -> None:
        for worker_id in worker_ids:
            worker = self.workers.get(worker_id)
            if worker is None:
                continue
            q = qt = inflight = 0
            for theirs in self._others.values():
                c = theirs.get(worker_id, _ZERO)
                q, qt, inflight = q + c[0], qt + c[1], inflight + c[2]
            s = worker.state
            if (s.others_queued, s.others_queued_tokens, s.others_inflight) != (q, qt, inflight):
                worker.update(others_queued=q, others_queued_tokens=qt, others_inflight=inflight)

    def _up(self) -> None:
        self.listening.set()
        self.redis.reached()

    def _down(self, err: Exception) -> None:
        self.listening.clear()
        self.redis.lost("hear the load", err)


def load_board_for(spec: SharedStateSpec, replica_id: str) -> LoadBoard:
    """The board `--redis-url` asks for: Redis's, or this router's alone."""
    if not spec.redis_url:
        return LocalLoad()
    from pdserve.router.replicas.redis_client import connect

    return RedisLoad(connect(spec), spec.redis_prefix, replica_id)
