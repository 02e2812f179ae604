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
    stats, host, swapped = scheduler.stats, scheduler.block_manager.host, scheduler.swapped
    return {"worker_id": worker_id, "role": role, "time": now, "waiting": len(waiting),
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            "running": len(running),
            "context_tokens": sum(r.num_computed_tokens for r in running),
            "reserved": scheduler.num_unfinished - len(running) - len(waiting) - len(swapped),
            "free_blocks": blocks.num_free_blocks, "num_blocks": blocks.num_blocks,
            "num_preemptions": stats.num_preemptions,
            "num_preemptions_for_waiting": stats.num_preemptions_for_waiting,
            "token_budget": scheduler.config.max_num_batched_tokens,
            "max_num_seqs": scheduler.config.max_num_seqs,
            "spec_num_drafts": stats.spec_decode_num_drafts,
            "spec_num_draft_tokens": stats.spec_decode_num_draft_tokens,
            "spec_num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
            "spec_accepted_per_pos": tuple(stats.spec_decode_num_accepted_tokens_per_pos),
            "swapped": len(swapped), "num_swapped_out": stats.num_swapped_out,
            "num_swapped_in": stats.num_swapped_in,
            "num_blocks_swapped_out": stats.num_blocks_swapped_out,
            "num_blocks_swapped_in": stats.num_blocks_swapped_in,
            "host_prefix_cache_hits": stats.host_prefix_cache_hits,
            "host_blocks_loaded": stats.num_host_blocks_loaded,
            "host_blocks_stored": host.num_stored if host else 0,
            "host_blocks_evicted": host.num_evicted if host else 0,
            "host_num_blocks": host.num_blocks if host else 0,
            "host_used_blocks": host.num_used_blocks if host else 0,
            "host_load_s_per_block": host.load_s_per_block if host else 0.0}


def report(worker_id: str, role: str, scheduler: Scheduler, now: float,
           steps: tuple[StepTiming, ...]) -> WorkerTelemetry:
    """Its telemetry now, with `steps` (those since the last report) and the prefix
    cache's events since the last report (taken from the block manager)."""
    blocks = scheduler.block_manager
    stored, evicted = net_prefix_events(blocks.take_prefix_events())
    host_stored, host_evicted = net_prefix_events(blocks.host.take_events()) \
        if blocks.host is not None else ((), ())
    return WorkerTelemetry(steps=steps, prefix_stored=stored, prefix_evicted=evicted,
                           host_prefix_stored=host_stored, host_prefix_evicted=host_evicted,
                           **gauges(worker_id, role, scheduler, now))
