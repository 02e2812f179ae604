"""In-flight load shared between router replicas over a real redis-server: each
replica's counts per worker reach the others' views (summed, never overwriting), go
back to zero with it, reach a replica that starts later, and stop counting once their
replica is silent."""
from __future__ import annotations

import asyncio
import contextlib

from pdserve.router.config import SharedStateSpec
from pdserve.router.pool.workers import WorkerHandle
from pdserve.router.replicas.redis_client import connect
from pdserve.router.replicas.shared_load import FULL_S, STALE_S, RedisLoad
from tests.polling import eventually


def board(server, replica: str) -> RedisLoad:
    spec = SharedStateSpec(redis_url=server.url, redis_prefix="t")
    return RedisLoad(connect(spec), spec.redis_prefix, replica, backoff_s=(0.05, 0.2))


def pool() -> dict[str, WorkerHandle]:
    """Two workers as one replica holds them (no calls are made to them here)."""
    return {w: WorkerHandle.of(w, client=None, role="decode") for w in ("d0", "d1")}


@contextlib.asynccontextmanager
async def boards(server, *replicas: str):
    started = []
    try:
        for replica in replicas:
            b, workers = board(server, replica), pool()
            await b.start(workers)
            started.append((b, workers))
        assert await eventually(lambda: all(b.listening.is_set() for b, _ in started))
        yield started
    finally:
        for b, _ in started:
            if b._tasks[0].done():  # a replica the test ended
                await b.client.aclose()
            else:
                await b.stop()


def others(workers, worker_id: str) -> tuple[int, int, int]:
    s = workers[worker_id].state
    return s.others_queued, s.others_queued_tokens, s.others_inflight


def test_each_replica_s_counts_are_summed_into_the_others_views(redis_server):
    async def scenario():
        async with boards(redis_server, "a", "b", "c") as [(_, wa), (_, wb), (_, wc)]:
            wa["d0"].update(queued=2, queued_tokens=300, inflight=1)
            wb["d0"].update(inflight=4)
            assert await eventually(lambda: others(wc, "d0") == (2, 300, 5))
            assert await eventually(lambda: others(wa, "d0") == (0, 0, 4))
            assert others(wb, "d0") == (2, 300, 1) and others(wc, "d1") == (0, 0, 0)
            state = wc["d0"].state
            assert (state.all_queued, state.all_queued_tokens, state.all_inflight) \
                == (2, 300, 5)
            assert state.reported_load.decode_seqs == 5  # no report yet: the counts
            wa["d0"].update(queued=0, queued_tokens=0, inflight=0)  # a's requests ended
            assert await eventually(lambda: others(wc, "d0") == (0, 0, 4))
    asyncio.run(scenario())


def test_a_replica_that_starts_later_hears_every_count_within_a_full_period(redis_server):
    async def scenario():
        async with boards(redis_server, "a") as [(_, wa)]:
            wa["d1"].update(inflight=3)
            async with boards(redis_server, "late") as [(_, late)]:
                assert await eventually(lambda: others(late, "d1") == (0, 0, 3),
                                        timeout_s=FULL_S * 3)
    asyncio.run(scenario())


def test_a_silent_replica_counts_no_more(redis_server):
    async def scenario():
        async with boards(redis_server, "a", "b") as [(a, wa), (_, wb)]:
            wa["d0"].update(inflight=2)
            assert await eventually(lambda: others(wb, "d0") == (0, 0, 2))
            for task in a._tasks:  # it dies: nothing more from it
                task.cancel()
            await asyncio.gather(*a._tasks, return_exceptions=True)
            assert await eventually(lambda: others(wb, "d0") == (0, 0, 0),
                                    timeout_s=STALE_S * 2)
    asyncio.run(scenario())
