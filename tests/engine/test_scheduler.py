"""The pure scheduler against worked cases. No torch, no model: a step's "model" just
samples token 7 for every request that reached the end of its known tokens."""
from __future__ import annotations

import zlib

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput
from pdserve.engine.steady_batch import advance, steps_ahead


def make(num_blocks=10_000, block_size=16, prefix=True, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix))


def request(rid: str, prompt_len: int, max_tokens: int = 16, priority: int = 0,
            first_token: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    return Request(rid, list(range(first_token, first_token + prompt_len)), params, 0.0)


def step(s: Scheduler):
    out = s.schedule()
    result = ModelRunnerOutput({r.request_id: 7 for r, n in zip(out.requests, out.num_scheduled)
                                if r.num_computed_tokens + n == r.num_tokens})
    return out, s.update(out, result)


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled)}


def test_budget_shared_by_decodes_and_a_prefill_chunk():
    s = make(max_num_batched_tokens=1024, max_num_seqs=0)
    for i in range(96):
        s.add_request(request(f"d{i}", 4, max_tokens=100))
    step(s)  # 96 short prefills -> all decoding now
    s.add_request(request("long", 1800))
    out, _ = step(s)
    assert scheduled(out)["long"] == 928 and out.total_num_scheduled_tokens == 1024
    out, _ = step(s)
    assert scheduled(out)["long"] == 872
    assert sum(n for rid, n in scheduled(out).items() if rid != "long") == 96


def test_long_prompt_runs_in_threshold_sized_chunks():
    s = make(long_prefill_token_threshold=512)
    s.add_request(request("r", 4000, max_tokens=1))
    chunks = []
    while s.has_unfinished():
        out, _ = step(s)
        chunks.append(scheduled(out)["r"])
    assert chunks == [512] * 7 + [416]


def test_prompts_scoring_their_tokens_share_a_steps_logits_rows():
    """Prompt logprobs take a vocabulary-wide logits row per prompt position: a step
    computes at most PROMPT_LOGPROB_ROWS of them, shared by the scoring prompts in it:
    their chunks are cut to what is left; each computes its prompt whole (no cache
    hit)."""
    from pdserve.engine.scheduler import PROMPT_LOGPROB_ROWS
    s = make(max_num_batched_tokens=2048)
    scoring = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    warm = request("warm", 600, max_tokens=1)
    s.add_request(warm)
    step(s)  # its blocks now cached: a scoring prompt of the same tokens ignores them
    a = Request("a", list(range(100, 700)), scoring, 0.0)
    s.add_request(a)
    s.add_request(Request("b", list(range(900, 1000)), scoring, 0.0))
    s.add_request(request("plain", 300, first_token=5000))
    for _ in range(2):  # "b" waits for rows (first come, first served: "plain" too)
        out, _ = step(s)
        assert scheduled(out) == {"a": PROMPT_LOGPROB_ROWS}
    out, _ = step(s)
    assert scheduled(out) == {"a": 600 - 2 * PROMPT_LOGPROB_ROWS,
                              "b": 100, "plain": 300}
    assert a.num_cached_tokens == 0


def test_prefix_hit_costs_only_the_uncached_tokens():
    s = make(block_size=8)
    s.add_request(request("warm", 600, max_tokens=1))
    step(s)
    s.add_request(request("hit", 1000, max_tokens=1))
    before = s.stats.prompt_tokens
    out, _ = step(s)
    assert scheduled(out)["hit"] == 400
    assert out.total_num_scheduled_tokens == 400
    assert s.stats.prompt_tokens - before == 1000
    assert s.stats.prefix_cache_hits == 600


def test_continuous_batching_admits_into_freed_slots():
    s = make(max_num_seqs=3)
    for rid, n in zip("ABCDE", (20, 40, 15, 30, 10)):
        s.add_request(request(rid, 8, max_tokens=n))
    steps, finished_at = 0, {}
    while s.has_unfinished():
        out, finished = step(s)
        steps += 1
        assert len(out.requests) <= 3
        for r in finished:
            finished_at[r.request_id] = steps
    assert steps == 45
    assert finished_at == {"C": 15, "A": 20, "E": 30, "B": 40, "D": 45}
    # Static batching of the same requests waits for each batch's longest member.
    assert max(20, 40, 15) + max(30, 10) == 70 > steps


def test_kv_pressure_preempts_the_lower_priority_request():
    # Each request alone fits in 8 blocks of 4 (26 tokens); the two together do not.
    s = make(num_blocks=8, block_size=4, policy="priority")
    s.add_request(request("low", 6, max_tokens=20, priority=5))
    s.add_request(request("high", 6, max_tokens=20, priority=0))
    preempted = []
    while s.has_unfinished():
        out, _ = step(s)
        preempted += out.preempted_request_ids
    assert preempted and set(preempted) == {"low"}
    assert s.stats.num_preemptions == len(preempted)
    assert s.block_manager.num_free_blocks == 8


def test_fcfs_preempts_the_latest_arrival_and_resumes_it_first():
    s = make(num_blocks=6, block_size=4, prefix=False)
    s.add_request(request("first", 8, max_tokens=12))
    s.add_request(request("second", 8, max_tokens=12))
    s.add_request(request("third", 4, max_tokens=4))
    out, _ = step(s)
    assert set(scheduled(out)) == {"first", "second", "third"}
    victims = []
    while not victims:
        out, _ = step(s)
        victims = out.preempted_request_ids
    assert victims == ["third"]
    assert s.waiting[0].request_id == "third"


def test_zero_max_num_seqs_is_unbounded():
    s = make(max_num_seqs=0, max_num_batched_tokens=100_000)
    for i in range(1000):
        s.add_request(request(f"r{i}", 4))
    out, _ = step(s)
    assert len(out.requests) == 1000


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=8)
    for i in range(20):
        s.add_request(request(f"r{i}", 4))
    out, _ = step(s)
    assert len(out.requests) == 8


def test_aborted_request_frees_its_blocks_at_the_next_boundary():
    s = make(num_blocks=64, block_size=16, prefix=False)
    s.add_request(request("a", 100, max_tokens=50))
    s.add_request(request("b", 30, max_tokens=50))
    step(s)
    assert s.block_manager.num_free_blocks == 64 - 7 - 2
    s.finish_requests(["a"], FinishReason.ABORT)
    out, _ = step(s)
    assert "a" not in scheduled(out)
    assert s.block_manager.num_free_blocks == 64 - 2  # only b's two blocks remain
    assert s.requests.keys() == {"b"}


def test_prioritize_prefill_admits_before_decodes():
    s = make(max_num_batched_tokens=64, prioritize_prefill=True, max_num_seqs=0)
    for i in range(10):
        s.add_request(request(f"d{i}", 4, max_tokens=50))
    step(s)
    s.add_request(request("p", 200))
    out, _ = step(s)
    assert scheduled(out)["p"] == 64  # the prefill took the whole budget first


def _state(s: Scheduler) -> tuple:
    bm = s.block_manager
    return ([(r.request_id, r.num_computed_tokens, r.num_tokens, list(r.output_token_ids),
              len(r.block_ids)) for r in s.running], bm.num_free_blocks,
            sorted(bm._cached), s.stats.generation_tokens)


def test_steady_decode_steps_at_once_equal_as_many_schedule_and_update_rounds():
    """The simulator's fast path: a batch decoding alone, n steps applied at once,
    ends exactly where n rounds of schedule() and update() end: tokens, progress,
    blocks (new ones taken as the batch crosses block ends; full ones cached) and
    counts. It stops short of a request's last token, of a batch with someone waiting,
    and of the blocks free."""
    def batch(num_blocks):
        s = make(num_blocks=num_blocks, block_size=4)
        for i, (prompt, max_tokens) in enumerate([(5, 30), (9, 12), (3, 40)]):
            s.add_request(request(f"r{i}", prompt, max_tokens, first_token=100 * (i + 1)))
        step(s)  # the prompts: every request now decodes
        return s
    per_step, at_once = batch(100), batch(100)
    steady = steps_ahead(at_once)
    assert steady == 12 - 1 - 1  # r1 has 11 tokens left; its last is a step of its own
    advance(at_once, steady, lambda r, n: [7] * n)
    for _ in range(steady):
        step(per_step)
    assert _state(at_once) == _state(per_step)
    # blocks run short first: 3 requests cross block ends every 4 steps
    assert steps_ahead(batch(9)) < steps_ahead(batch(100))
    short = batch(9)
    n = steps_ahead(short)
    advance(short, n, lambda r, k: [7] * k)
    assert short.block_manager.num_free_blocks >= 0 and not short.waiting
    waiting = batch(100)
    waiting.add_request(request("late", 5))
    assert steps_ahead(waiting) == 0


def _replay(seed: int, steady_path: bool, policy: str, prioritize_prefill: bool,
            model: int = 0) -> list:
    """A seeded run of arrivals, aborts, stop tokens and preemption (few blocks); what
    every step scheduled and finished, and the end state. `model` seeds the tokens."""
    import random
    rng = random.Random(seed)
    s = make(num_blocks=16, block_size=4, max_num_batched_tokens=48, policy=policy,
             prioritize_prefill=prioritize_prefill)
    log, steady_steps = [], 0
    for t in range(160):
        if rng.random() < 0.15:
            params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True,
                                    stop_token_ids=[3] if rng.random() < 0.5 else [],
                                    priority=rng.randint(0, 2))
            prompt = [rng.randint(1, 60) for _ in range(rng.randint(1, 20))]
            s.add_request(Request(f"t{t}", prompt, params, 0.0))
        if s.running and rng.random() < 0.05:  # by id: the two paths order running apart
            s.finish_requests([rng.choice(sorted(r.request_id for r in s.running))],
                              FinishReason.ABORT)
        out = s.schedule()
        steady_steps += out.steady
        if out.requests and rng.random() < 0.05:  # an abort while the step runs
            s.finish_requests([rng.choice(sorted(r.request_id for r in out.requests))],
                              FinishReason.ABORT)
        # The "model": a token that depends only on the request and its position
        # (crc32, not hash(): the same tokens in every process).
        result = ModelRunnerOutput({
            r.request_id: 1 + zlib.crc32(repr((model, (r.request_id, r.num_tokens)))
                                         .encode()) % 40
            for r, n in zip(out.requests, out.num_scheduled)
            if r.num_computed_tokens + n == r.num_tokens})
        batch = [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled)]
        finished = [r.request_id for r in s.update(out, result)]
        if not steady_path:
            s._steady = None  # every step the general way
        log.append((sorted(batch) if policy == "priority" else batch,
                    out.preempted_request_ids, finished))
    return log, _state(s), s.stats.num_preemptions, steady_steps


def test_the_steady_batch_path_schedules_what_the_general_path_does():
    """schedule() takes an unchanged all-decode batch whole (only requests entering
    a new block looked at) and update() appends its tokens in one tight loop: the
    same batches, finishes, preemptions, blocks, cached hashes and tokens as every
    step taken the general way."""
    preemptions = 0
    # Models 7 and 9 with priority: an abort while the two paths hold running in other
    # orders (the general path sorts it by rank, a steady step leaves it): the abort
    # picks by id, and the runs stay equal.
    for seed, policy, prioritize, model in [
            (1, "fcfs", False, 0), (2, "priority", False, 0), (3, "fcfs", True, 0),
            (4, "fcfs", False, 0), (2, "priority", False, 7), (2, "priority", False, 9)]:
        fast = _replay(seed, True, policy, prioritize, model)
        general = _replay(seed, False, policy, prioritize, model)
        assert fast[:3] == general[:3], (seed, policy, prioritize, model)
        assert fast[3] > 50 and general[3] == 0  # the fast path ran, and often
        preemptions += fast[2]
    assert preemptions > 0  # blocks ran short along the way


def test_drafts_are_scheduled_within_max_tokens_and_the_budget_and_never_preempt():
    s = make(max_num_batched_tokens=64)
    s.add_request(request("r", 5, max_tokens=4))
    step(s)  # the prompt and its first token: 6 tokens, 3 more to go
    s.propose({"r": [1, 2, 3, 4, 5, 6]})  # more than are left
    out = s.schedule()
    # the step emits the kept drafts and one token more: 2 drafts reach max_tokens
    assert out.spec_token_ids == {"r": [1, 2]} and scheduled(out) == {"r": 3}
    tight = make(max_num_batched_tokens=3)
    tight.add_request(request("r", 2, max_tokens=40))
    step(tight)
    tight.propose({"r": [1, 2, 3, 4]})
    assert tight.schedule().spec_token_ids == {"r": [1, 2]}  # 3 tokens of budget
    # Drafts whose slots are not free are dropped: a plain decode, nobody preempted.
    full = make(num_blocks=2, block_size=4)
    full.add_request(request("a", 3, max_tokens=20))
    full.add_request(request("b", 3, max_tokens=20))
    step(full)  # each holds one block, 4 tokens: the next token needs a new block
    full.propose({"a": [1, 2, 3]})
    out = full.schedule()
    assert not out.spec_token_ids and not out.preempted_request_ids
    assert scheduled(out) == {"a": 1, "b": 1}


class Clock:
    """The time the scheduler reads, set by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(clock: Clock, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(10_000, 16, True), clock=clock)


def slo_request(rid: str, prompt_len: int, ttft_slo_s: float | None, arrival: float = 0.0,
                priority: int = 0, first_token: int = 100) -> Request:
    r = request(rid, prompt_len, max_tokens=1000, priority=priority, first_token=first_token)
    r.arrival_time, r.ttft_slo_s = arrival, ttft_slo_s
    return r


def full_batch(s: Scheduler, n: int = 2) -> None:
    """n decodes running, max_num_seqs reached."""
    for i in range(n):
        s.add_request(slo_request(f"d{i}", 4, None, first_token=200 + 50 * i))
    step(s)


def test_a_request_waiting_past_its_share_of_the_ttft_slo_takes_a_decode_s_place():
    clock = Clock()
    s = timed(clock, max_num_seqs=2, waiting_timeout_share=0.5)
    full_batch(s)
    s.add_request(slo_request("late", 30, ttft_slo_s=1.0, arrival=0.0))
    clock.now = 0.4  # within half its TTFT: it waits behind the full batch
    out, _ = step(s)
    assert "late" not in scheduled(out) and not out.preempted_request_ids
    clock.now = 0.6
    out, _ = step(s)
    assert scheduled(out)["late"] == 30
    assert out.preempted_request_ids == ["d1"]  # the later arrival, lowest in fcfs rank
    assert s.stats.num_preemptions_for_waiting == 1 and "d0" in scheduled(out)
    out, _ = step(s)  # the victim waits for room: it is not preempted for a rule twice
    assert {"d0", "late"} <= set(scheduled(out)) and "d1" not in scheduled(out)


def test_the_waiting_timeout_spares_higher_priority_and_preempted_decodes_and_can_be_off():
    clock = Clock()
    s = timed(clock, max_num_seqs=2, policy="priority")
    for i, priority in enumerate((0, 0)):
        s.add_request(slo_request(f"d{i}", 4, None, priority=priority, first_token=200 + 50 * i))
    step(s)
    s.add_request(slo_request("low", 30, ttft_slo_s=1.0, priority=5))
    clock.now = 10.0
    out, _ = step(s)  # every running decode outranks it: it waits
    assert "low" not in scheduled(out) and not out.preempted_request_ids
    for decode in s.running:
        decode.num_preemptions = 1  # each paid one recompute already
    s.add_request(slo_request("urgent", 30, ttft_slo_s=1.0, priority=0, first_token=900))
    out, _ = step(s)
    assert not out.preempted_request_ids  # no decode pays twice
    # no SLO, a moved request (tokens out already), or the flag off: no preemption
    for config in ({}, {"waiting_timeout": False}):
        t = timed(clock, max_num_seqs=2, **config)
        clock.now = 0.0
        full_batch(t)
        t.add_request(slo_request("none", 30, ttft_slo_s=None if not config else 1.0))
        moved = slo_request("moved", 30, ttft_slo_s=1.0, first_token=600)
        moved.output_token_ids.append(7)
        moved.num_tokens += 1
        t.add_request(moved)
        clock.now = 10.0
        out, _ = step(t)
        assert not out.preempted_request_ids and set(scheduled(out)) == {"d0", "d1"}


def test_the_waiting_timeout_makes_room_in_the_kv_pool_only_where_a_victim_frees_enough():
    clock = Clock()
    s = Scheduler(SchedulerConfig(max_num_seqs=0), BlockManager(6, 16, True), clock=clock)
    for i in range(2):  # two decodes of 2 blocks each (17 tokens): 4 of 6 blocks held
        s.add_request(slo_request(f"d{i}", 17, None, first_token=200 + 50 * i))
    step(s)
    s.add_request(slo_request("wide", 100, ttft_slo_s=1.0))  # 7 blocks: no victim frees it
    clock.now = 5.0
    out, _ = step(s)
    assert not out.preempted_request_ids and "wide" not in scheduled(out)
    s.finish_requests(["wide"], FinishReason.ABORT)
    s.add_request(slo_request("fits", 60, ttft_slo_s=1.0, first_token=700))  # 4 blocks
    out, _ = step(s)
    assert out.preempted_request_ids == ["d1"] and scheduled(out)["fits"] == 60
