"""A worker's telemetry as its scheduler stands: what every worker (a real one, or
the simulator's) reports with each step. Pure: no torch, no clock read."""
from __future__ import annotations

from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_shape import StepTiming
from pdserve.worker.messages import WorkerTelemetry, net_prefix_events

# A worker reports with every step, and at least this often while idle (as long as
# its engine makes progress: silence means it stalled).
IDLE_REPORT_INTERVAL_S = 0.5


def gauges(worker_id: str, role: str, scheduler: Scheduler, now: float) -> dict:
    """The load figures of a WorkerTelemetry, by field name."""
    blocks, running, waiting = scheduler.block_manager, scheduler.running, scheduler.waiting
    stats = scheduler.stats
    return {"worker_id": worker_id, "role": role, "time": now, "waiting": len(waiting),
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            "running": len(running),
            "context_tokens": sum(r.num_computed_tokens for r in running),
            "reserved": scheduler.num_unfinished - len(running) - len(waiting),
            "free_blocks": blocks.num_free_blocks, "num_blocks": blocks.num_blocks,
            "num_preemptions": stats.num_preemptions,
            "num_preemptions_for_waiting": stats.num_preemptions_for_waiting,
            "token_budget": scheduler.config.max_num_batched_tokens,
            "max_num_seqs": scheduler.config.max_num_seqs,
            "spec_num_drafts": stats.spec_decode_num_drafts,
            "spec_num_draft_tokens": stats.spec_decode_num_draft_tokens,
            "spec_num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
            "spec_accepted_per_pos": tuple(stats.spec_decode_num_accepted_tokens_per_pos)}


def report(worker_id: str, role: str, scheduler: Scheduler, now: float,
           steps: tuple[StepTiming, ...]) -> WorkerTelemetry:
    """Its telemetry now, with `steps` (those since the last report) and the prefix
    cache's events since the last report (taken from the block manager)."""
    stored, evicted = net_prefix_events(scheduler.block_manager.take_prefix_events())
    return WorkerTelemetry(steps=steps, prefix_stored=stored, prefix_evicted=evicted,
                           **gauges(worker_id, role, scheduler, now))
