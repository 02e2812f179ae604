from pdserve.engine.block_manager import BlockManager, pack_tokens
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), 0.0)


def admit(bm: BlockManager, r: Request) -> list[int]:
    hits = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, r.num_tokens - len(hits) * bm.block_size, hits)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r, r.num_tokens)
    return hits


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(16, 4)
    a, b = req("a", list(range(10))), req("b", list(range(8)) + [99, 98, 97])
    admit(bm, a)
    hits = admit(bm, b)
    assert hits == a.block_ids[:2]
    assert bm.blocks[hits[0]].ref_cnt == 2
    bm.free(a)
    assert bm.blocks[hits[0]].ref_cnt == 1
    assert bm.num_free_blocks == 16 - 3  # b's two shared + one own block
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_serve_hits_until_reused_lru():
    bm = BlockManager(4, 4)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    again = req("again", list(range(9)))
    assert bm.get_computed_blocks(again) == [0, 1]
    # Free queue is now [3, 2, 1, 0]: the never-used block, then `a`'s blocks tail
    # first. Three blocks of unrelated tokens evict 3, 2 and 1; the chain keeps block 0.
    admit(bm, req("other", [500 + i for i in range(12)]))
    assert bm.get_computed_blocks(req("again2", list(range(9)))) == [0]


def test_hit_requires_equal_tokens_not_just_equal_hash():
    bm = BlockManager(8, 4)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.blocks[a.block_ids[0]].tokens = pack_tokens([9, 9, 9, 9])  # as if another prompt collided
    assert bm.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == []


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(8, 4)
    admit(bm, req("a", list(range(8))))
    assert len(bm.get_computed_blocks(req("b", list(range(8))))) == 1


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    r = req("a", list(range(12)))
    assert not bm.allocate_slots(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def forked(bm: BlockManager, n: int) -> tuple[Request, list[Request]]:
    """A 10-token prompt admitted (two full blocks and a partial one) and its choices
    1 .. n-1 forked from it after its prompt."""
    parent = req("p", list(range(10)))
    admit(bm, parent)
    children = [parent.fork(i) for i in range(1, n)]
    for child in children:
        bm.fork(parent, child, 10)
        child.num_computed_tokens = 10
    return parent, children


def test_choices_share_blocks_and_copy_the_partial_one_before_writing_it():
    """fork: the prompt's blocks reference-counted, none copied; own_tail: the shared
    partly filled block copied (within the device, before the next forward pass) for
    each writer but the last, its source pinned until the copy ran."""
    bm = BlockManager(8, 4)
    parent, children = forked(bm, 3)
    assert [c.block_ids for c in children] == [parent.block_ids] * 2
    assert [bm.blocks[b].ref_cnt for b in parent.block_ids] == [3, 3, 3]
    assert bm.num_free_blocks == 5 and parent.shared_tail
    tail = parent.block_ids[2]
    assert bm.own_tail(children[0]) and not children[0].shared_tail
    copies = bm.take_copies()
    assert copies.within == [(tail, children[0].block_ids[2])] and not copies.to_host
    assert bm.blocks[tail].ref_cnt == 3  # its reference is now the copy's pin
    bm.release_copies()
    assert bm.blocks[tail].ref_cnt == 2 and bm.num_free_blocks == 4
    assert bm.own_tail(children[1]) and bm.own_tail(parent)  # the last keeps it: no copy
    assert len(bm.take_copies().within) == 1
    bm.release_copies()
    assert len({r.block_ids[2] for r in (parent, *children)}) == 3
    assert [bm.blocks[b].ref_cnt for b in parent.block_ids[:2]] == [3, 3]
    for r in (parent, *children):
        bm.free(r)
    assert bm.num_free_blocks == 8


def test_a_copy_on_write_without_a_free_block_changes_nothing():
    bm = BlockManager(3, 4)
    parent, (child,) = forked(bm, 2)
    before = list(child.block_ids)
    assert not bm.own_tail(child)
    assert child.block_ids == before and child.shared_tail and not bm.has_copies
    bm.free(parent)  # its sibling gone, the block is the child's alone: no copy
    assert bm.own_tail(child) and child.block_ids == before and not bm.has_copies
