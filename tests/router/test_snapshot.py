"""The running requests' TPOT budgets a snapshot carries: what each request's SLO
leaves per remaining step, memoized per worker until its version changes."""
from dataclasses import dataclass, field

import pytest

from pdserve.router.cluster_state import WorkerState
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.snapshot import snapshot


@dataclass
class Running:
    priority: int = 0
    tpot_slo_s: float | None = 0.05
    first_token_at: float | None = 100.0
    num_output_tokens: int = 1
    max_tokens: int = 11


@dataclass(eq=False)
class Held:
    flights: dict = field(default_factory=dict)
    version: int = 0


def budgets_at(held: dict, wall_now: float, memo: dict):
    workers = tuple(WorkerState(worker_id=wid, role="decode") for wid in held)
    return snapshot(workers, held, now=0.0, wall_now=wall_now, config=RouterConfig(),
                    model=ModelInfo("m", 4096, 1000, 16, 1000), transfer={},
                    deadlines=memo).budgets


def test_a_budget_spreads_what_is_left_of_the_slo_over_the_remaining_tokens():
    held = {"d0": Held({"a": Running(), "b": Running(tpot_slo_s=None),
                        "c": Running(first_token_at=None), "e": Running(priority=2)})}
    b = budgets_at(held, wall_now=100.2, memo={})["d0"]
    # 10 more tokens by 100 + 0.05 x 10; 0.3 s left for them: 0.03 s a step
    assert list(b.remaining) == [10, 10] and list(b.priority) == [0, 2]
    assert b.allowance_s == pytest.approx([0.03, 0.03])


def test_budgets_follow_the_clock_and_a_new_version_but_not_a_stale_one():
    request = Running()
    held = {"d0": Held({"a": request})}
    memo: dict = {}
    assert budgets_at(held, 100.2, memo)["d0"].allowance_s == pytest.approx([0.03])
    assert budgets_at(held, 100.3, memo)["d0"].allowance_s == pytest.approx([0.02])
    request.num_output_tokens = 6  # unannounced: the memo still reads 10 remaining
    assert list(budgets_at(held, 100.3, memo)["d0"].remaining) == [10]
    held["d0"].version += 1  # WorkerHandle.progressed
    b = budgets_at(held, 100.3, memo)["d0"]
    assert list(b.remaining) == [5] and b.allowance_s == pytest.approx([0.04])


def test_a_worker_without_timed_requests_has_empty_budgets_and_an_unknown_one_none():
    budgets = budgets_at({"d0": Held()}, 100.0, {})
    assert len(budgets["d0"]) == 0
    with pytest.raises(KeyError):
        budgets["d9"]
