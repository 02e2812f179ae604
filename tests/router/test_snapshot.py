"""The running requests' TPOT budgets a snapshot carries: what each request's SLO
leaves per remaining step, from the rows a worker's handle keeps as its requests
join, leave and are sent tokens (budget_rows.py), checked against the rule over the
requests one by one."""
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.budget_rows import BudgetRows
from pdserve.router.policy.cluster_state import WorkerState
from pdserve.router.policy.snapshot import snapshot


@dataclass(eq=False)
class Running:
    priority: int = 0
    tpot_slo_s: float | None = 0.05
    first_token_at: float | None = 100.0
    num_output_tokens: int = 1
    max_tokens: int = 11


@dataclass(eq=False)
class Held:
    """A WorkerHandle's flights and rows."""
    flights: list = field(default_factory=list)
    budget_rows: BudgetRows = field(default_factory=BudgetRows)

    def hold(self, *requests):
        for r in requests:
            self.flights.append(r)
            self.budget_rows.join(r)
        return self


def budgets_at(held: dict, wall_now: float):
    workers = tuple(WorkerState(worker_id=wid, role="decode") for wid in held)
    return snapshot(workers, held, now=0.0, wall_now=wall_now, config=RouterConfig(),
                    model=ModelInfo("m", 4096, 1000, 16, 1000), transfer={}).budgets


def by_the_rule(requests, now: float):
    """(priority, allowance, remaining) of each request with a TPOT SLO, in the order
    held: one without its first token yet has all its allowance ahead."""
    rows = []
    for r in requests:
        if r.tpot_slo_s is None:
            continue
        n = r.num_output_tokens
        total = max(r.max_tokens, n + 1)
        if r.first_token_at is None:  # all its tokens but the first are decode steps
            left = max(total - max(n, 1), 1)
            rows.append((r.priority, r.tpot_slo_s * (total - 1) / left, left))
            continue
        deadline = r.first_token_at + r.tpot_slo_s * (total - 1)
        rows.append((r.priority, (deadline - now) / (total - n), total - n))
    return rows


def test_a_budget_spreads_what_is_left_of_the_slo_over_the_remaining_tokens():
    held = {"d0": Held().hold(Running(), Running(tpot_slo_s=None),
                              Running(first_token_at=None), Running(priority=2))}
    b = budgets_at(held, wall_now=100.2)["d0"]
    # 10 more tokens by 100 + 0.05 x 10; 0.3 s left for them: 0.03 s a step. The one
    # waiting for its first token (placed, not yet in the worker's batch) may take
    # 0.05 x 10 once it comes: 0.05 s a step.
    assert list(b.remaining) == [10, 10, 10] and list(b.priority) == [0, 0, 2]
    assert b.allowance_s == pytest.approx([0.03, 0.05, 0.03])
    assert b.num_waiting == 1
    # Placed, nothing sent yet: its 10 tokens after the first may take 0.05 s each.
    fresh = budgets_at({"d0": Held().hold(Running(first_token_at=None, num_output_tokens=0))},
                       wall_now=100.2)["d0"]
    assert list(fresh.remaining) == [10] and fresh.allowance_s == pytest.approx([0.05])


def test_budgets_follow_the_clock_and_the_tokens_sent():
    request, waiting = Running(), Running(first_token_at=None)
    held = {"d0": Held().hold(request, waiting)}
    assert budgets_at(held, 100.2)["d0"].allowance_s == pytest.approx([0.03, 0.05])
    assert budgets_at(held, 100.3)["d0"].allowance_s == pytest.approx([0.02, 0.05])
    request.num_output_tokens = 6
    held["d0"].budget_rows.progressed(request)  # WorkerHandle.progressed
    b = budgets_at(held, 100.3)["d0"]
    assert list(b.remaining) == [5, 10] and b.allowance_s == pytest.approx([0.04, 0.05])
    waiting.first_token_at = 100.25  # its first token: its deadline runs from then on
    b = budgets_at(held, 100.3)["d0"]
    assert b.allowance_s == pytest.approx([0.04, 0.045]) and b.num_waiting == 0
    held["d0"].budget_rows.leave(request)
    assert list(budgets_at(held, 100.3)["d0"].remaining) == [10]


def test_a_worker_without_timed_requests_has_empty_budgets_and_an_unknown_one_none():
    budgets = budgets_at({"d0": Held()}, 100.0)
    assert len(budgets["d0"]) == 0
    with pytest.raises(KeyError):
        budgets["d9"]


@pytest.mark.parametrize("seed", range(4))
def test_the_rows_follow_the_rule_as_requests_join_leave_and_get_tokens(seed):
    rng = random.Random(seed)
    rows, held, checked = BudgetRows(capacity=2), [], 0
    for step in range(3000):
        roll = rng.random()
        if roll < 0.3 or not held:  # joins (at times one held already: no second row)
            r = rng.choice(held) if held and rng.random() < 0.05 else Running(
                priority=rng.randrange(3), tpot_slo_s=rng.choice((None, 0.02, 0.05)),
                first_token_at=rng.choice((None, 100.0 + step * 1e-3)),
                num_output_tokens=rng.randrange(3), max_tokens=rng.randrange(1, 50))
            if r not in held:
                held.append(r)
            rows.join(r)
        elif roll < 0.55:  # leaves (in bursts: the rows are compacted)
            for _ in range(rng.choice((1, 1, 1, 20))):
                if held:
                    rows.leave(held.pop(rng.randrange(len(held))))
        else:  # tokens, the first among them perhaps (past max_tokens too)
            r = rng.choice(held)
            if r.first_token_at is None:
                r.first_token_at = 100.0 + step * 1e-3
            r.num_output_tokens += rng.randrange(1, 4)
            rows.progressed(r)
        if step % 7 == 0:
            now = 100.0 + step * 1e-3
            b, expected = rows.at(now), by_the_rule(held, now)
            assert len(rows) == sum(r.tpot_slo_s is not None for r in held)
            assert [(p, r) for p, _, r in expected] == list(zip(b.priority.tolist(),
                                                                b.remaining.tolist()))
            assert b.allowance_s.tolist() == pytest.approx([a for _, a, _ in expected])
            assert b.num_waiting == sum(r.tpot_slo_s is not None and r.first_token_at is None
                                        for r in held)
            checked += bool(expected)
    assert checked > 200
    rows.leave(Running())  # one it never held: nothing happens
    assert np.array_equal(rows.at(200.0).remaining,
                          [t for _, _, t in by_the_rule(held, 200.0)])
