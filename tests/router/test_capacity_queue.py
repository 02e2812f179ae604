"""The wait for capacity as an ordered queue, without Ray or workers: waiters are
asked in deadline order (then priority, then arrival) when capacity frees; only the
first that fits is woken; a bounded number that do not fit are asked per freeing."""
from __future__ import annotations

import asyncio

from pdserve.router.capacity_queue import CapacityQueue
from pdserve.router.policy.decision import Colocate, Reject

REFUSED = Reject("no room", 1.0, "kv")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_earliest_deadline_goes_first_then_priority_then_arrival():
    async def scenario():
        queue, room, asked, woken = CapacityQueue(), {"slots": 0}, [], []

        def fits(name):
            def ask():
                asked.append(name)
                if room["slots"]:
                    room["slots"] -= 1
                    return Colocate("w")
                return REFUSED
            return ask

        async def wait(name, deadline, priority):
            await queue.wait(deadline, priority, fits(name))
            woken.append(name)
            queue.freed()  # it took its place: the next is asked
        tasks = [asyncio.ensure_future(wait(*w)) for w in (
            ("late", 9.0, 0), ("urgent-low", 1.0, 5), ("urgent", 1.0, 0), ("mid", 5.0, 0),
            ("urgent-2nd", 1.0, 0))]
        await _settle()
        room["slots"] = 2
        queue.freed()
        await _settle()
        first_round = list(woken)
        room["slots"] = 3
        queue.freed()
        await _settle()
        await asyncio.gather(*tasks)
        return first_round, woken, len(queue)
    first_round, woken, left = asyncio.run(scenario())
    assert first_round == ["urgent", "urgent-2nd"]
    assert woken == ["urgent", "urgent-2nd", "urgent-low", "mid", "late"] and left == 0


def test_a_freeing_asks_only_a_bounded_number_of_waiters_that_do_not_fit():
    async def scenario():
        queue, asked = CapacityQueue(max_misses=3), []

        def never(i):
            return lambda: asked.append(i) or REFUSED
        tasks = [asyncio.ensure_future(queue.wait(float(i), 0, never(i))) for i in range(20)]
        await _settle()
        queue.freed()
        queue.freed()  # several freeings before the round runs: one round
        await _settle()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return asked, len(queue)
    asked, left = asyncio.run(scenario())
    assert asked == [0, 1, 2] and left == 0  # the cancelled waiters left the queue


def test_a_waiter_woken_as_it_gives_up_passes_its_turn_on():
    async def scenario():
        queue = CapacityQueue()
        room = {"slots": 1}

        def take():
            if room["slots"]:
                room["slots"] -= 1
                return Colocate("w")
            return REFUSED
        leaving = asyncio.ensure_future(queue.wait(1.0, 0, take))
        staying = asyncio.ensure_future(queue.wait(2.0, 0, take))
        await _settle()
        queue.freed()
        await asyncio.sleep(0)  # the round runs: `leaving` is woken ...
        leaving.cancel()  # ... but gives up before it runs
        room["slots"] = 1  # what it would have taken is free again
        await asyncio.wait_for(staying, 5)
        return staying.result()
    assert asyncio.run(scenario()) == Colocate("w")


def test_a_waiter_cancelled_after_a_round_was_scheduled_is_passed_over():
    """A request that gives up (its caller cancelled) between a freeing and the round it
    scheduled: its future is cancelled before its own handler leaves the queue. The
    round must pass over it and wake the next, not fail setting a cancelled future."""
    async def scenario():
        queue, asked = CapacityQueue(), []

        def fits(name):
            return lambda: asked.append(name) or Colocate("w")
        leaving = asyncio.ensure_future(queue.wait(1.0, 0, fits("leaving")))
        staying = asyncio.ensure_future(queue.wait(2.0, 0, fits("staying")))
        await _settle()
        queue.freed()  # the round is scheduled ...
        leaving.cancel()  # ... and the first waiter gives up before it runs
        decision = await asyncio.wait_for(staying, 5)
        await asyncio.gather(leaving, return_exceptions=True)
        return decision, asked, len(queue)
    decision, asked, left = asyncio.run(scenario())
    assert decision == Colocate("w") and asked == ["staying"] and left == 0
