"""Which rank of a prefill worker sends which KV heads to which rank of a decode worker,
when the two are tensor-parallel groups of different sizes; pure.

Each rank's KV cache holds the KV heads its query heads read
(engine/parallel/sharding.py): a contiguous range, or one head replicated past Hkv
ranks. A decode rank receives each of its heads from one prefill rank that holds it,
so a head replicated on several prefill ranks travels once to each decode rank that
holds it; among its holders the one of index (decode rank mod holders) sends it, so
the replicas share the sending. Consecutive heads from one source to one destination
are one route: one transfer between the two ranks, over the head slices named here,
under the request's id (a receiving rank takes a request's heads in parts: receiver.py).

    P TP 1 -> D TP 2, Hkv 4:  (0 -> 0, heads 0:2 -> 0:2), (0 -> 1, 2:4 -> 0:2)
    P TP 2 -> D TP 1, Hkv 4:  (0 -> 0, 0:2 -> 0:2), (1 -> 0, 0:2 -> 2:4)
    P TP 2 -> D TP 2, Hkv 1:  (0 -> 0, 0:1 -> 0:1), (1 -> 1, 0:1 -> 0:1)

The route of rank 0 to rank 0 always exists (both hold KV head 0) and comes first.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.parallel.sharding import kv_head_range


@dataclass(frozen=True)
class HeadRoute:
    src_rank: int
    dst_rank: int
    src_heads: tuple[int, int]  # [start, end) of the sender's local KV heads
    dst_heads: tuple[int, int]  # the same heads among the receiver's local ones

    @property
    def num_heads(self) -> int:
        return self.src_heads[1] - self.src_heads[0]


def head_routes(num_heads: int, num_kv_heads: int, src_size: int, dst_size: int
                ) -> list[HeadRoute]:
    """Every route from a group of `src_size` ranks to one of `dst_size`, ordered by
    destination rank, then source rank. Both sizes must split the model (the engine
    checked them at start)."""
    src = [kv_head_range(num_heads, num_kv_heads, src_size, i) for i in range(src_size)]
    routes: list[HeadRoute] = []
    for j in range(dst_size):
        first_j, count_j = kv_head_range(num_heads, num_kv_heads, dst_size, j)
        runs: list[list[int]] = []  # [src rank, first global head, last global head + 1]
        for head in range(first_j, first_j + count_j):
            holders = [i for i, (first, count) in enumerate(src) if first <= head < first + count]
            i = holders[j % len(holders)]
            if runs and runs[-1][0] == i and runs[-1][2] == head:
                runs[-1][2] = head + 1
            else:
                runs.append([i, head, head + 1])
        for i, start, end in sorted(runs):
            first_i = src[i][0]
            routes.append(HeadRoute(src_rank=i, dst_rank=j,
                                    src_heads=(start - first_i, end - first_i),
                                    dst_heads=(start - first_j, end - first_j)))
    return routes
