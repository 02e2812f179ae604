"""Faults injected at the engine's boundaries: at the sampler (a fault one request's
rows reproduce) and in the forward pass (a fault of the whole step). In a worker
actor they are installed with `actor.__ray_call__.remote(fn, ...)`, which runs
fn(actor, ...) in the actor's process; Ray's workers import this module by name."""
from __future__ import annotations

POISON = 1999  # a prompt that starts with this token fails at the sampler


class FaultySampler:
    """The engine's sampler, except that it raises for the rows `poisoned(request)`
    picks (alone or in any batch), or for any batch of more than one row."""

    def __init__(self, real, poisoned=lambda request: False, batches_fail: bool = False):
        self.real, self.poisoned, self.batches_fail = real, poisoned, batches_fail

    def sample(self, logits, requests):
        if any(self.poisoned(r) for r in requests):
            raise RuntimeError("injected fault")
        if self.batches_fail and len(requests) > 1:
            raise RuntimeError("injected batch fault")
        return self.real.sample(logits, requests)

    def forget(self, request_id):
        self.real.forget(request_id)


def starts_with_poison(request) -> bool:
    return request.prompt_token_ids[0] == POISON


def poison_sampler(actor) -> None:
    """In a worker actor: requests whose prompt starts with POISON fail to sample."""
    runner = actor.worker.loop.engine.runner
    runner.sampler = FaultySampler(runner.sampler, starts_with_poison)


def break_forward(actor) -> None:
    """In a worker actor: the next forward pass raises, which no request explains."""
    runner = actor.worker.loop.engine.runner

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault in the forward pass")
    runner.execute = broken
