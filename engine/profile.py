"""A worker's start-up profile: a few synthetic steps of the shapes serving will see
(prompts of growing length alone, then a decode batch), run before the worker takes
traffic. It warms the engine up, so the first real requests do not pay for first
calls, and its StepTimings seed the latency model with this worker's own speed
instead of a guess. The engine's counters are reset afterwards."""
from __future__ import annotations

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import SchedulerStats

PROMPT_LENGTHS = (8, 32, 128, 512)
DECODE_BATCH = 4
DECODE_STEPS = 8
_MAX_STEPS = 10_000  # a profile that cannot finish fails the worker's start, not hangs it


def profile(engine: LLMEngine) -> int:
    """Runs the profile on the calling thread (before the engine loop starts);
    returns the steps it took. Prompts that would not fit a quarter of the KV cache
    or the context are left out."""
    vocab = engine.model_config.vocab_size
    blocks = engine.block_manager
    room = blocks.num_blocks * blocks.block_size // 4
    limit = min(room // DECODE_BATCH, engine.max_model_len - DECODE_STEPS - 1)
    lengths = [n for n in PROMPT_LENGTHS if n <= limit]
    before = engine.num_steps
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, n in enumerate(lengths):
        _run(engine, {f"__profile-p{i}": _tokens(i, n, vocab)}, params)
    if lengths:
        decode = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True)
        _run(engine, {f"__profile-d{j}": _tokens(100 + j, lengths[-1] // 2 or 1, vocab)
                      for j in range(DECODE_BATCH)}, decode)
    engine.scheduler.stats = SchedulerStats()
    return engine.num_steps - before


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    """Ids no real prompt is likely to share a block with."""
    return [(seed * 7919 + k * 104729) % (vocab - 4) + 4 for k in range(n)]


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    for _ in range(_MAX_STEPS):
        if not engine.has_unfinished():
            return
        engine.step()
    raise RuntimeError(f"the start-up profile made no end within {_MAX_STEPS} steps")
