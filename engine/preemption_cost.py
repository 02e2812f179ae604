"""preemption_mode auto's rule, the seeds': a victim's KV is swapped when copying its
blocks out and back in costs less than recomputing its tokens. The copy is priced at
the measured host copy time per block (engine/host_kv_cache.py); the recompute by
this engine's own latency model, fitted from its recent steps (its start-up profile
first). Pure: the engine hands in its step timings and the figures."""
from __future__ import annotations

from typing import Callable, Sequence

from pdserve.engine.latency_model import StepCost, StepModel
from pdserve.engine.step_shape import StepTiming

REFIT_EVERY_STEPS = 32  # the fit is refreshed at most this often (a preemption storm
# asks once per victim)


def recompute_seconds(cost: StepCost, num_tokens: int) -> float:
    """A prompt of num_tokens computed again from nothing, alone."""
    return cost.prefill_token_s * num_tokens \
        + cost.prefill_pair_s * (num_tokens * (num_tokens + 1) // 2)


class PreemptionCosts:
    def __init__(self, copy_s_per_block: float,
                 timings: Callable[[], Sequence[StepTiming]], num_steps: Callable[[], int]):
        self.copy_s_per_block = copy_s_per_block  # one block out and back in
        self._timings = timings
        self._num_steps = num_steps
        self._cost: StepCost | None = None
        self._fitted_at = 0

    def cost(self) -> StepCost:
        steps = self._num_steps()
        if self._cost is None or not 0 <= steps - self._fitted_at < REFIT_EVERY_STEPS:
            self._cost = StepModel.seeded(list(self._timings())).cost()
            self._fitted_at = steps
        return self._cost

    def swap_is_cheaper(self, num_tokens: int, num_blocks: int) -> bool:
        return num_blocks * self.copy_s_per_block < recompute_seconds(self.cost(), num_tokens)
