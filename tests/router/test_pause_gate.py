"""PauseGate: the live moves off one worker pause together (live_move.py)."""
import asyncio

from pdserve.router.live_move import PauseGate


async def _arrive(gate: PauseGate, log: list, name: str, timeout_s: float = 5.0) -> None:
    await gate.arrive(timeout_s)
    log.append(name)


def test_moves_wait_for_each_other_and_one_that_gives_up_lets_them_go():
    async def scenario():
        gate, passed = PauseGate(), []
        for _ in range(3):
            gate.enter()
        first = asyncio.ensure_future(_arrive(gate, passed, "a"))
        second = asyncio.ensure_future(_arrive(gate, passed, "b"))
        await asyncio.sleep(0)  # both are waiting at the gate now
        await asyncio.sleep(0)
        waiting = list(passed)
        gate.leave()  # the third gave up before arriving
        await asyncio.gather(first, second)
        return waiting, sorted(passed)
    waiting, passed = asyncio.run(scenario())
    assert waiting == []
    assert passed == ["a", "b"]


def test_the_last_to_arrive_opens_it_and_a_late_move_passes_at_once():
    async def scenario():
        gate, passed = PauseGate(), []
        gate.enter()
        gate.enter()
        first = asyncio.ensure_future(_arrive(gate, passed, "a"))
        await asyncio.sleep(0)
        before = list(passed)
        await _arrive(gate, passed, "b")
        await first
        gate.enter()  # a move started after the gate opened
        await asyncio.wait_for(_arrive(gate, passed, "late"), 1.0)
        return before, passed
    before, passed = asyncio.run(scenario())
    assert before == []
    assert sorted(passed[:2]) == ["a", "b"] and passed[2] == "late"


def test_the_wait_is_bounded():
    async def scenario():
        gate, passed = PauseGate(), []
        gate.enter()
        gate.enter()  # this one never arrives nor leaves
        await _arrive(gate, passed, "a", timeout_s=0.05)
        return passed
    assert asyncio.run(scenario()) == ["a"]
