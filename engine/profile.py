"""A worker's start-up profile: a few synthetic steps of the shapes serving will see
(prompts of growing length alone, then a decode batch), run before the worker takes
traffic. It warms the engine up, so the first real requests do not pay for first
calls, and its StepTimings seed the latency model with this worker's own speed
instead of a guess. The engine's counters are reset afterwards.

`startup_rounds` is the plan, pure: the simulator's workers run the same one through
their scheduler, so a simulated router is seeded as a real one is."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import SchedulerStats

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

PROMPT_LENGTHS = (8, 32, 128, 512)
DECODE_BATCH = 4
DECODE_STEPS = 8
_MAX_STEPS = 10_000  # a profile that cannot finish fails the worker's start, not hangs it

Round = tuple[dict[str, list[int]], SamplingParams]  # request id -> prompt; their params


def startup_rounds(vocab_size: int, num_blocks: int, block_size: int,
                   max_model_len: int) -> list[Round]:
    """The profile's rounds, each run to its end before the next: each prompt alone,
    then a decode batch. Prompts that would not fit a quarter of the KV cache or the
    context are left out."""
    room = num_blocks * block_size // 4
    limit = min(room // DECODE_BATCH, max_model_len - DECODE_STEPS - 1)
    lengths = [n for n in PROMPT_LENGTHS if n <= limit]
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rounds: list[Round] = [({f"__profile-p{i}": _tokens(i, n, vocab_size)}, first)
                           for i, n in enumerate(lengths)]
    if lengths:
        decode = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True)
        rounds.append(({f"__profile-d{j}": _tokens(100 + j, lengths[-1] // 2 or 1, vocab_size)
                        for j in range(DECODE_BATCH)}, decode))
    return rounds


def profile(engine: LLMEngine) -> int:
    """Runs the profile on the calling thread (before the engine loop starts);
    returns the steps it took."""
    blocks = engine.block_manager
    before = engine.num_steps
    for prompts, params in startup_rounds(engine.model_config.vocab_size, blocks.num_blocks,
                                          blocks.block_size, engine.max_model_len):
        _run(engine, prompts, params)
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
