"""Faults injected at the engine's boundaries: at the sampler (a fault one request's
rows reproduce) and in the forward pass (a fault of the whole step). In a worker
actor they are installed with `actor.__ray_call__.remote(fn, ...)`, which runs
fn(actor, ...) in the actor's process; Ray's workers import this module by name."""
from __future__ import annotations

import time
from dataclasses import replace

POISON = 1999  # a prompt that starts with this token fails at the sampler


class FaultySampler:
    """The engine's sampler, except that it raises for the rows `poisoned(request)`
    picks (alone or in any batch), or for any batch of more than one row."""

    def __init__(self, real, poisoned=lambda request: False, batches_fail: bool = False):
        self.real, self.poisoned, self.batches_fail = real, poisoned, batches_fail

    def sample(self, logits, requests, params=None):
        if any(self.poisoned(r) for r in requests):
            raise RuntimeError("injected fault")
        if self.batches_fail and len(requests) > 1:
            raise RuntimeError("injected batch fault")
        return self.real.sample(logits, requests, params)

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


SLOW = 1998  # a prompt that starts with this token is decoded slowly


class SlowSampler:
    """The engine's sampler, taking `delay_s` more for every batch that holds a row
    `slow(request)` picks: a request whose decode outlasts what a test waits for."""

    def __init__(self, real, slow, delay_s: float):
        self.real, self.slow, self.delay_s = real, slow, delay_s

    def sample(self, logits, requests, params=None):
        if any(self.slow(r) for r in requests):
            time.sleep(self.delay_s)  # the injected slowness
        return self.real.sample(logits, requests, params)

    def forget(self, request_id):
        self.real.forget(request_id)


def slow_sampler(actor, delay_s: float = 0.02, first_token: int = SLOW) -> None:
    """In a worker actor: requests whose prompt starts with `first_token` (SLOW unless
    said) take delay_s more per step."""
    runner = actor.worker.loop.engine.runner
    runner.sampler = SlowSampler(
        runner.sampler, lambda request: request.prompt_token_ids[0] == first_token, delay_s)


def failing_resume(scheduler) -> None:
    """A scheduler (a worker actor's, or a simulated worker's) whose every resume of a
    request moved live fails, as if its state had gone wrong."""
    def resume_moved(request_id: str):
        raise ValueError(f"request {request_id} cannot resume here (injected)")
    scheduler.resume_moved = resume_moved


def actor_scheduler(actor):
    """In a worker actor: its engine's scheduler."""
    return actor.worker.loop.engine.scheduler


def slow_prefill_layers(actor, delay_s: float = 0.1) -> None:
    """In a worker actor: every prefill step that sends KV waits `delay_s` as each
    layer's KV goes out, so its requests stay mid-transfer that much longer."""
    role = actor.worker.prefill_role
    export = role.export

    def slow_export(out):
        exported = export(out)
        if exported is None:
            return None

        def slow_send(layer: int) -> None:
            time.sleep(delay_s)  # the injected slowness
            exported.send(layer)
        return replace(exported, send=slow_send)
    role.export = slow_export


def pid(actor) -> int:
    """In a worker actor: its process id."""
    import os
    return os.getpid()


def slow_moves(actor, delay_s: float = 0.5) -> None:
    """In a worker actor: every copy of a live migration it sends waits delay_s first,
    so a move stays under way that much longer."""
    moves = actor.worker.moves
    send = moves.send

    def slow_send(*args):
        time.sleep(delay_s)  # the injected slowness (on the caller's thread)
        return send(*args)
    moves.send = slow_send
