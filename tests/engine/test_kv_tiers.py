"""Host memory's tiers on the pure scheduler and block manager: swap preemption (its
modes, resumption before new requests, a full swap area falling back to recompute),
the host prefix tier (write-through stores, LRU eviction, hits loaded back, counted
as cached), and the pins that keep a copy's blocks from anyone else until the step
that runs it computed. No torch: the copies are checked as the lists a step carries,
replayed on a dictionary standing for the KV tensors."""
from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.host_pool import HostBlockPool
from pdserve.engine.request import FinishReason, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput
from tests.engine.test_scheduler import request, scheduled


def make(num_blocks: int, swap: int = 0, prefix: int = 0, block_size: int = 4,
         swap_is_cheaper=None, caching: bool = True, **cfg) -> Scheduler:
    host = HostBlockPool(swap, prefix) if swap or prefix else None
    return Scheduler(SchedulerConfig(**cfg),
                     BlockManager(num_blocks, block_size, caching, host),
                     swap_is_cheaper=swap_is_cheaper)


class Memory:
    """The KV tensors, as {block: the token positions of the request it holds}: a
    step writes each scheduled token's (request, position) into its slot; copies move
    whole blocks. A request reading a slot that does not hold its own token there is
    what a wrong copy (or a block handed out while a copy still needs it) would do."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.device: dict[int, dict[int, tuple[str, int]]] = {}
        self.host: dict[int, dict[int, tuple[str, int]]] = {}

    def copy(self, copies) -> None:
        for d, h in copies.to_host:
            self.host[h] = dict(self.device.get(d, {}))
        for h, d in copies.to_device:
            self.device[d] = dict(self.host.get(h, {}))

    def run(self, s: Scheduler):
        """One step as LLMEngine.step runs it (one rank): the copies, the forward pass,
        update, then the blocks it filled stored at once."""
        out = s.schedule()
        if out.kv_copies:
            self.copy(out.kv_copies)
        sampled = {}
        batch = list(zip(out.requests, out.num_scheduled))
        for r, n in batch:  # every request writes its tokens (a layer's KV, all rows)
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                block = r.block_ids[pos // self.bs]
                self.device.setdefault(block, {})[pos % self.bs] = (r.token_at(pos), pos)
        for r, n in batch:  # then attention reads every earlier slot of each
            start = r.num_computed_tokens
            for pos in range(start + n):
                held = self.device.get(r.block_ids[pos // self.bs], {}).get(pos % self.bs)
                assert held == (r.token_at(pos), pos), (
                    f"{r.request_id} reads {held} at position {pos}")
            if start + n == r.num_tokens:
                sampled[r.request_id] = 7
        finished = s.update(out, ModelRunnerOutput(sampled))
        bm = s.block_manager
        if bm.has_copies:
            self.copy(bm.take_copies())
            bm.release_copies()
        return out, finished


def two_growing(s: Scheduler) -> Memory:
    """Two requests of 8 tokens decoding 12 more each, on a Memory of 4-token blocks:
    in 6 blocks they cannot both finish, and the second is preempted."""
    s.add_request(request("first", 8, max_tokens=12))
    s.add_request(request("second", 8, max_tokens=12))
    return Memory(4)


def a_then_b(s: Scheduler) -> Memory:
    """'a' (13 tokens: 3 full blocks, stored in the host tier), then 'b' (21 tokens)
    whose blocks push a's out of a 6-block device: a's prefix is in the tier alone."""
    memory = Memory(4)
    s.add_request(request("a", 13, max_tokens=1))
    drain(s, memory)
    s.add_request(request("b", 21, max_tokens=1, first_token=500))
    drain(s, memory)
    return memory


def drain(s: Scheduler, memory: Memory, limit: int = 500) -> list:
    outs = []
    for _ in range(limit):
        if not s.has_unfinished():
            return outs
        outs.append(memory.run(s)[0])
    raise AssertionError("did not finish")


@pytest.mark.parametrize("caching", [False, True])
def test_swap_preemption_resumes_from_host_memory_before_new_requests(caching):
    """Without prefix caching every block comes back from host memory; with it, the
    blocks the device still caches are taken from there instead."""
    s = make(num_blocks=6, swap=16, preemption_mode="swap", caching=caching)
    memory = two_growing(s)
    memory.run(s)
    victims = []
    while not victims:
        out, _ = memory.run(s)
        victims = out.preempted_request_ids
    assert victims == ["second"]
    second = s.requests["second"]
    assert second.status is RequestStatus.SWAPPED and second.host_block_ids
    assert second.num_computed_tokens > 8  # kept: it resumes where it was
    computed = second.num_computed_tokens
    s.add_request(request("third", 4, max_tokens=2))  # a newcomer waits for it
    outs = drain(s, memory)
    resumed = next(i for i, o in enumerate(outs) if "second" in scheduled(o))
    third = next(i for i, o in enumerate(outs) if "third" in scheduled(o))
    assert resumed <= third
    assert scheduled(outs[resumed])["second"] == 1  # a decode: nothing recomputed
    copies = outs[resumed].kv_copies
    copied = len(copies.to_device) if copies else 0
    stats = s.stats
    assert stats.num_swapped_out == stats.num_swapped_in == 1
    assert stats.num_blocks_swapped_out == -(-computed // 4)
    assert stats.num_blocks_swapped_in == copied
    if caching:
        assert copied < -(-computed // 4)  # its full blocks were still cached
    else:
        assert copied == -(-computed // 4)
    assert s.block_manager.num_free_blocks == 6
    assert s.block_manager.host.num_free_swap_blocks == 16


def test_a_full_swap_area_falls_back_to_recompute_and_no_request_fails():
    s = make(num_blocks=6, swap=1, preemption_mode="swap")
    memory = two_growing(s)
    finished = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        finished += memory.run(s)[1]
    assert s.stats.num_preemptions >= 1 and s.stats.num_swapped_out == 0
    assert sorted(r.request_id for r in finished) == ["first", "second"]
    assert all(r.finish_reason is FinishReason.LENGTH for r in finished)


@pytest.mark.parametrize("cheaper,swapped", [(True, 1), (False, 0)])
def test_auto_swaps_when_the_copy_is_cheaper(cheaper, swapped):
    asked = []

    def swap_is_cheaper(tokens, blocks):
        asked.append((tokens, blocks))
        return cheaper
    s = make(num_blocks=6, swap=16, preemption_mode="auto", swap_is_cheaper=swap_is_cheaper)
    memory = two_growing(s)
    drain(s, memory)
    assert s.stats.num_preemptions >= 1 and s.stats.num_swapped_out == swapped
    tokens, blocks = asked[0]
    assert tokens > 8 and blocks == -(-tokens // 4)


def test_recompute_mode_never_swaps():
    s = make(num_blocks=6, swap=16, preemption_mode="recompute")
    memory = two_growing(s)
    drain(s, memory)
    assert s.stats.num_preemptions >= 1 and s.stats.num_swapped_out == 0


def test_an_aborted_swapped_request_frees_its_host_blocks():
    s = make(num_blocks=6, swap=16, preemption_mode="swap")
    memory = two_growing(s)
    while not s.swapped:
        memory.run(s)
    s.finish_requests(["second"], FinishReason.ABORT)
    drain(s, memory)
    assert s.block_manager.host.num_free_swap_blocks == 16
    assert s.block_manager.host.num_used_blocks == 0
    assert s.block_manager.num_free_blocks == 6


def test_a_swapped_out_block_is_no_one_elses_until_its_copy_ran():
    """Between schedule() and update() (the forward pass, when another thread may
    reserve blocks) the blocks a swap-out still copies are not free; once the step
    computed, they are."""
    s = make(num_blocks=6, swap=16, preemption_mode="swap")
    memory = two_growing(s)
    memory.run(s)
    while True:
        out = s.schedule()
        if out.preempted_request_ids:
            break
        s.update(out, ModelRunnerOutput({r.request_id: 7 for r in out.requests}))
        if s.block_manager.has_copies:  # (caching on, no host tier: none)
            s.block_manager.take_copies()
    copied = {d for d, _ in out.kv_copies.to_host}
    taken = {b for r in out.requests for b in r.block_ids}
    free_now = s.block_manager.num_free_blocks
    held_back = copied - taken  # not handed out again in this step: pinned
    assert held_back and free_now == 6 - len(taken) - len(held_back)
    s.update(out, ModelRunnerOutput({r.request_id: 7 for r in out.requests}))
    assert s.block_manager.num_free_blocks == free_now + len(held_back)


def test_a_request_swapped_mid_prefill_resumes_its_chunks_exactly():
    s = make(num_blocks=6, swap=32, preemption_mode="swap", long_prefill_token_threshold=4,
             max_num_batched_tokens=6)
    memory = Memory(4)
    s.add_request(request("decoding", 4, max_tokens=20))
    memory.run(s)
    s.add_request(request("long", 18, max_tokens=2, first_token=300))
    mid_prefill = 0
    for _ in range(300):  # Memory asserts every read: swapped chunks came back whole
        if not s.has_unfinished():
            break
        out, _ = memory.run(s)
        mid_prefill += sum(1 for rid in out.preempted_request_ids
                           if s.requests[rid].host_block_ids
                           and s.requests[rid].num_computed_tokens < 18)
    assert mid_prefill >= 1 and not s.requests


def test_the_host_tier_stores_blocks_as_computed_and_serves_them_back():
    """Device cache too small to keep a prompt's blocks past the next request: the
    third request, repeating the first, loads them from the host tier (counted as
    cached tokens, the host part apart) and reads what the first computed."""
    s = make(num_blocks=6, prefix=16)
    memory = a_then_b(s)
    s.add_request(request("c", 13, max_tokens=1))
    out, _ = memory.run(s)  # Memory checks c reads a's KV in the loaded blocks
    c = out.requests[0]
    assert scheduled(out)["c"] == 1  # 12 of 13 tokens served from the host tier
    assert c.num_cached_tokens == c.num_host_cached_tokens == 12
    assert s.stats.host_prefix_cache_hits == 12 and s.stats.num_host_blocks_loaded == 3
    assert s.block_manager.host.num_stored == 3 + 5  # a's 3 full blocks, then b's 5
    assert len(out.kv_copies.to_device) == 3


def test_the_host_tier_drops_its_least_recently_used_block_for_room():
    s = make(num_blocks=2, prefix=3)  # the device holds one request's two blocks
    memory = Memory(4)
    for i, first in enumerate((100, 200, 300, 400)):
        s.add_request(request(f"r{i}", 5, max_tokens=1, first_token=first))
        drain(s, memory)
    host = s.block_manager.host
    assert host.num_stored == 4 and host.num_evicted == 1  # r0's block made room for r3's
    s.add_request(request("again0", 5, max_tokens=1, first_token=100))  # dropped: no hit
    s.add_request(request("again3", 5, max_tokens=1, first_token=400))
    drain(s, memory)
    assert s.requests == {}
    assert s.stats.host_prefix_cache_hits == 4  # again3's one block, from the host
    assert host.num_stored == 5 and host.num_evicted == 2  # again0's stored over r1's


def test_a_reservation_counts_and_loads_host_hits():
    """The decode role: a prompt whose prefix the host tier holds is reserved with
    those tokens counted as cached (its prefill worker need not send them); the loads
    run with the next step."""
    s = make(num_blocks=6, prefix=16)
    memory = a_then_b(s)
    r = request("remote", 13, max_tokens=2)
    assert s.reserve(r)
    assert r.num_cached_tokens == r.num_host_cached_tokens == 12
    assert r.num_computed_tokens == 12
    # the prompt's last token's KV arrives (written as the prefill worker's would be)
    memory.device.setdefault(r.block_ids[3], {})[0] = (r.token_at(12), 12)
    s.admit_prefilled("remote", 7)
    out, _ = memory.run(s)
    assert len(out.kv_copies.to_device) == 3 and scheduled(out) == {"remote": 1}


def test_host_pool_pins_defer_reuse_of_a_freed_swap_block():
    host = HostBlockPool(2, 2)
    ids = host.allocate_swap(2)
    assert host.allocate_swap(1) is None
    host.free_swap(ids)  # still pinned by their copy
    assert host.num_free_swap_blocks == 0
    host.release(ids)
    assert host.num_free_swap_blocks == 2
    first = host.store(b"a", b"1")
    second = host.store(b"b", b"2")
    assert host.store(b"c", b"3") is None  # every tier block pinned: not stored
    host.release([first, second])
    assert host.lookup(b"a", b"1") == first  # a is most recently used now
    assert host.store(b"c", b"3") == second  # b was least recently used
    assert host.lookup(b"b", b"2") is None and host.lookup(b"a", b"x") is None


def test_a_block_waiting_for_its_store_is_no_one_elses():
    """A request that finishes as its blocks fill: until their store to the host tier
    ran, those blocks are not free (a reservation from another thread, whose KV lands
    at any time, must not be handed one); after it, they are."""
    s = make(num_blocks=4, prefix=8)
    s.add_request(request("a", 8, max_tokens=1))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": 7}))
    bm = s.block_manager
    assert not s.requests and bm.has_copies
    assert bm.num_free_blocks == 4 - 2
    assert not s.reserve(request("remote", 12, max_tokens=1, first_token=900))
    copies = bm.take_copies()
    assert sorted(h for _, h in copies.to_host) == sorted(
        bm.host.lookup(r_hash, tokens) for r_hash, tokens in _tier(bm))
    bm.release_copies()
    assert bm.num_free_blocks == 4


def _tier(bm: BlockManager):
    """(hash, packed tokens) of every block the host tier holds."""
    host = bm.host
    return [(h, host._tokens[i]) for h, i in host._lru.items()]


def test_more_host_memory_than_is_free_is_refused_naming_the_flag(llama_dir):
    """At start: by launch before any worker (this host), and by the engine (its
    own host, every rank's share counted)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.router.launch import launch
    with pytest.raises(ValueError, match=r"--swap-space: host KV memory of 100000 GiB swap "
                                         r"\+ 0 GiB offloading .* than the [0-9.]+ GiB of "
                                         "host memory free"):
        launch(EngineConfig.from_kwargs(str(llama_dir), swap_space=100_000))
    with pytest.raises(ValueError, match="--kv-offloading-size: .* GiB of host memory free"):
        LLMEngine.from_kwargs(str(llama_dir), kv_offloading_size=100_000)
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        EngineConfig.from_kwargs(str(llama_dir), swap_space=-1)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineConfig.from_kwargs(str(llama_dir), preemption_mode="never")


def test_auto_prices_a_recompute_with_its_attention_pairs():
    """The quadratic term counts (a float coefficient, never floored away): a long
    context costs more to recompute than its tokens alone say."""
    from pdserve.engine.latency_model import StepCost
    from pdserve.engine.preemption_cost import PreemptionCosts, recompute_seconds
    cost = StepCost(base_s=0.0, prefill_token_s=0.0, prefill_pair_s=1e-9,
                    decode_seq_s=0.0, decode_context_s=0.0)
    assert recompute_seconds(cost, 2000) == pytest.approx(1e-9 * 2000 * 2001 / 2)
    costs = PreemptionCosts(1e-5, lambda: (), lambda: 0)
    costs._cost = cost
    assert costs.swap_is_cheaper(2000, 125)  # 1.25 ms of copies against 2 ms
    assert not costs.swap_is_cheaper(100, 7)


def test_the_waiting_timeout_counts_host_hits_in_the_room_it_needs():
    """A request past its SLO whose prefix is in the host tier needs blocks for those
    hits too. Here no running decode's blocks make that room (e's 2 would hold its
    own 2 tokens, not the 3 host blocks before them): nobody is preempted for it."""
    now = [0.0]
    s = Scheduler(SchedulerConfig(max_num_seqs=0),
                  BlockManager(5, 4, True, HostBlockPool(0, 16)), clock=lambda: now[0])
    memory = Memory(4)
    s.add_request(request("a", 12, max_tokens=1))  # its 3 blocks, stored in the tier
    drain(s, memory)
    s.add_request(request("d", 11, max_tokens=30, first_token=500))  # 3 blocks
    s.add_request(request("e", 7, max_tokens=30, first_token=700))  # 2 blocks
    memory.run(s)  # a's blocks are all taken on the device: only the tier has them
    late = request("late", 14, max_tokens=1)  # a's 12 tokens, then 2 of its own
    late.ttft_slo_s = 1.0
    s.add_request(late)
    now[0] = 10.0
    assert s.block_manager.get_host_hits(late, 0)
    out, _ = memory.run(s)
    assert not out.preempted_request_ids and s.stats.num_preemptions_for_waiting == 0
    assert late in s.waiting


def test_with_prioritize_prefill_swapped_requests_resume_exactly():
    """prioritize_prefill's order (prompts, new requests, decodes, then swapped
    requests in what the decodes left): every victim swaps and resumes, every read
    finds its own KV, nothing is left in either tier."""
    s = make(num_blocks=6, swap=16, preemption_mode="swap", prioritize_prefill=True)
    memory = Memory(4)
    s.add_request(request("first", 8, max_tokens=14))
    s.add_request(request("second", 8, max_tokens=14))
    s.add_request(request("third", 3, max_tokens=14, first_token=300))
    drain(s, memory)
    assert s.stats.num_swapped_out >= 1 and s.stats.num_swapped_in == s.stats.num_swapped_out
    assert s.stats.num_preemptions == s.stats.num_swapped_out
    assert s.block_manager.num_free_blocks == 6 and s.block_manager.host.num_used_blocks == 0


def test_a_swap_in_never_takes_a_cached_block_past_its_computed_tokens():
    """Swapped with 6 tokens of its 12 computed (its second block half filled), it
    comes back to a block of its own for that half, not to the cached block another
    request holds for the same 4 tokens: its forward pass writes those slots again."""
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams
    bm = BlockManager(8, 4, True, HostBlockPool(8, 0))
    victim = Request("victim", list(range(100, 112)), SamplingParams(max_tokens=2), 0.0)
    assert bm.allocate_slots(victim, 6)
    victim.num_computed_tokens = 6
    assert bm.swap_out(victim)
    twin = Request("twin", list(range(100, 108)) + [1, 2, 3, 4], SamplingParams(), 0.0)
    assert bm.allocate_slots(twin, 12)
    twin.num_computed_tokens = 12
    bm.cache_full_blocks(twin, 12)  # the victim's first 2 blocks' tokens, cached
    assert bm.swap_in(victim, 6) == 1  # its second block copied back
    assert victim.block_ids[0] == twin.block_ids[0]  # a whole computed block: shared
    assert victim.block_ids[1] != twin.block_ids[1]


def test_a_reservation_waits_while_a_request_is_swapped():
    s = make(num_blocks=6, swap=16, preemption_mode="swap")
    memory = two_growing(s)
    while not s.swapped:
        memory.run(s)
    assert not s.reserve(request("remote", 4, max_tokens=1, first_token=900))
    drain(s, memory)
    assert s.reserve(request("remote", 4, max_tokens=1, first_token=900))


def test_blocks_with_loads_pending_are_not_swapped_out_before_they_are_filled():
    """A reservation's host hits are loaded with the next step; a block whose load is
    still pending is never copied out (it would copy what was there before)."""
    s = make(num_blocks=6, swap=16, prefix=16, preemption_mode="swap")
    memory = a_then_b(s)
    r = request("remote", 13, max_tokens=2)
    assert s.reserve(r)
    loading = set(s.block_manager.loading)
    assert loading and loading <= set(r.block_ids)
    assert not s._swaps(r)
    memory.device.setdefault(r.block_ids[3], {})[0] = (r.token_at(12), 12)
    s.admit_prefilled("remote", 7)
    memory.run(s)
    assert not s.block_manager.loading and s._swaps(r)
