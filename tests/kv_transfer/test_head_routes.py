"""KV between tensor-parallel groups of different sizes: the routes (pure) and each
route as a real transfer of a head slice, between the ranks' own caches."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.parallel.sharding import kv_head_range
from pdserve.kv_transfer import (
    KVReceiver,
    KVSender,
    TransferAborted,
    TransferConfig,
    TransferRefused,
)
from pdserve.kv_transfer.heads import head_routes

SIZES = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (4, 1), (8, 8)])
@pytest.mark.parametrize("src,dst", SIZES)
def test_every_receiving_rank_gets_each_of_its_heads_once_from_a_rank_holding_it(
        num_heads, num_kv_heads, src, dst):
    routes = head_routes(num_heads, num_kv_heads, src, dst)
    assert (routes[0].src_rank, routes[0].dst_rank) == (0, 0)
    for j in range(dst):
        first_j, count_j = kv_head_range(num_heads, num_kv_heads, dst, j)
        got = []
        for route in (r for r in routes if r.dst_rank == j):
            first_i, count_i = kv_head_range(num_heads, num_kv_heads, src, route.src_rank)
            heads = range(first_i + route.src_heads[0], first_i + route.src_heads[1])
            assert 0 <= route.src_heads[0] < route.src_heads[1] <= count_i
            assert list(heads) == list(range(first_j + route.dst_heads[0],
                                             first_j + route.dst_heads[1]))
            got.extend(heads)
        assert sorted(got) == list(range(first_j, first_j + count_j))  # each once
    # Replicas share the sending: no source sends more heads than it must.
    sent = [sum(r.num_heads for r in routes if r.src_rank == i) for i in range(src)]
    received = sum(kv_head_range(num_heads, num_kv_heads, dst, j)[1] for j in range(dst))
    assert sum(sent) == received
    assert max(sent) <= -(-received // min(src, num_kv_heads)) * max(1, src // num_kv_heads)


LAYERS, BLOCKS, BLOCK, HEAD_DIM = 2, 12, 4, 8


def _rank_caches(whole: list[torch.Tensor], num_heads: int, num_kv_heads: int, size: int,
                 rank: int) -> list[torch.Tensor]:
    first, count = kv_head_range(num_heads, num_kv_heads, size, rank)
    return [layer[:, :, :, first:first + count].clone() for layer in whole]


@pytest.mark.parametrize("src,dst", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_each_route_moves_its_head_slice_and_every_rank_holds_its_heads(src, dst):
    num_heads, num_kv_heads = 8, 2
    whole = [torch.randn(2, BLOCKS, BLOCK, num_kv_heads, HEAD_DIM,
                         generator=torch.Generator().manual_seed(layer)) for layer in range(LAYERS)]
    config = TransferConfig(timeout_s=20, connect_timeout_s=20)
    receivers = [KVReceiver([torch.zeros_like(c) for c in
                             _rank_caches(whole, num_heads, num_kv_heads, dst, j)], config)
                 for j in range(dst)]
    senders = [KVSender(f"p{i}", _rank_caches(whole, num_heads, num_kv_heads, src, i), config)
               for i in range(src)]
    src_blocks, dst_blocks = [7, 1, 10], [2, 9, 4]
    try:
        routes = head_routes(num_heads, num_kv_heads, src, dst)
        for j, receiver in enumerate(receivers):  # each rank its blocks, all its heads
            receiver.expect("req", dst_blocks, watched=j == 0)
        for route in routes:  # ranks of two sizes hold different numbers of heads
            senders[route.src_rank].connect(receivers[route.dst_rank].address, any_heads=True)
        handles = [(route, senders[route.src_rank].begin(
            "req", receivers[route.dst_rank].address, src_blocks, dst_blocks,
            heads=route.src_heads, dst_heads=route.dst_heads)) for route in routes]
        for i, sender in enumerate(senders):  # one step per sending rank, as a forward
            mine = [h for r, h in handles if r.src_rank == i]
            assert not sender.announce(mine)
            for layer in range(LAYERS):
                assert not sender.send_layers(mine, layer)
        for route, handle in handles:
            per_block = 2 * BLOCK * route.num_heads * HEAD_DIM * 4
            assert senders[route.src_rank].finish(handle).bytes_sent == \
                per_block * len(src_blocks) * LAYERS
        receivers[0].wait("req", timeout=20)  # every part of rank 0's heads landed
        for j, receiver in enumerate(receivers):
            first, count = kv_head_range(num_heads, num_kv_heads, dst, j)
            for layer in range(LAYERS):
                want = whole[layer][:, src_blocks, :, first:first + count]
                assert torch.equal(receiver.kv_caches[layer][:, dst_blocks], want)
                others = [b for b in range(BLOCKS) if b not in dst_blocks]
                assert not receiver.kv_caches[layer][:, others].any()
            assert receiver.num_pending == 0  # the unwatched ones forgot theirs on landing
    finally:
        for side in senders + receivers:
            side.close()


def _sent(sender: KVSender, handles) -> None:
    assert not sender.announce(handles)
    for layer in range(LAYERS):
        sender.send_layers(handles, layer)


@pytest.fixture
def two_senders():
    """A receiver of 2 KV heads (the requests it hands back, in order) and two senders
    of the same layout, as two prefill ranks."""
    caches = [torch.randn(2, BLOCKS, BLOCK, 2, HEAD_DIM) for _ in range(LAYERS)]
    config = TransferConfig(timeout_s=20, connect_timeout_s=20)
    released: list[str] = []
    receiver = KVReceiver([torch.zeros_like(c) for c in caches], config,
                          on_release=released.append)
    first, second = KVSender("p0", caches, config), KVSender("p1", caches, config)
    yield receiver, released, first, second
    first.close()
    second.close()
    receiver.close()


def test_parts_claiming_the_same_heads_or_heads_not_here_are_refused_and_free_the_blocks(
        two_senders):
    receiver, released, first, second = two_senders
    receiver.expect("req", [0, 1])
    one = first.begin("req", receiver.address, [3, 4], [0, 1], heads=(0, 1))
    _sent(first, [one])
    assert first.finish(one).bytes_sent > 0  # one part landed: not yet the request
    landed = receiver.landed("req")
    assert not landed.done()
    again = second.begin("req", receiver.address, [3, 4], [0, 1], heads=(0, 1))
    _sent(second, [again])
    with pytest.raises(TransferRefused, match=r"KV heads \[0, 1\] are being received"):
        second.finish(again)
    assert released == ["req"]  # the request failed whole: its blocks went back
    assert isinstance(landed.exception(timeout=5), TransferRefused)

    receiver.expect("next", [2])
    wide = first.begin("next", receiver.address, [5], [2], heads=(0, 1), dst_heads=(1, 2))
    _sent(first, [wide])
    first.finish(wide)  # one part landed (before the whole's BEGIN: two pairs race)
    whole = second.begin("next", receiver.address, [5], [2])
    _sent(second, [whole])
    with pytest.raises(TransferRefused, match="already being received"):
        second.finish(whole)
    with pytest.raises(ValueError, match="KV heads"):
        first.begin("x", receiver.address, [1], [1], heads=(1, 3))


def test_a_part_aborted_by_its_sender_ends_the_other_parts_and_frees_the_blocks(
        two_senders):
    receiver, released, first, second = two_senders
    receiver.expect("req", [0, 1])
    one = first.begin("req", receiver.address, [3, 4], [0, 1], heads=(0, 1))
    two = second.begin("req", receiver.address, [3, 4], [0, 1], heads=(1, 2),
                       dst_heads=(1, 2))
    assert not first.announce([one]) and not second.announce([two])
    first.send_layers([one], 0)
    second.send_layers([two], 0)
    first.abort(one)
    for layer in range(1, LAYERS):
        second.send_layers([two], layer)
    # aborted with the request, or refused if its BEGIN came after (two pairs race)
    with pytest.raises((TransferAborted, TransferRefused)):
        second.finish(two)
    with pytest.raises(TransferAborted):
        receiver.wait("req", timeout=5)
    assert released == ["req"] and receiver.num_pending == 0


def test_caches_of_different_heads_pair_only_when_told_or_when_the_receiver_has_ranks():
    """Between workers of one rank each a difference in KV heads is a layout mismatch,
    refused at pairing as before; ranks of tensor-parallel workers say so, and a
    receiver that publishes its other ranks is one."""
    from pdserve.kv_transfer import LayoutMismatchError
    config = TransferConfig(timeout_s=20, connect_timeout_s=20)
    receiver = KVReceiver([torch.zeros(2, BLOCKS, BLOCK, 1, HEAD_DIM)], config)
    sender = KVSender("p", [torch.zeros(2, BLOCKS, BLOCK, 2, HEAD_DIM)], config)
    try:
        with pytest.raises(LayoutMismatchError, match="num_kv_heads: 2 here vs 1 there"):
            sender.connect(receiver.address)
        receiver.publish_ranks(["127.0.0.1:1"])
        sender.connect(receiver.address)
        assert sender.ranks_of(receiver.address) == ["127.0.0.1:1"]
    finally:
        sender.close()
        receiver.close()
