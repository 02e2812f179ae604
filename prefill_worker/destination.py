"""A decode worker as a prefill worker's ranks send to it: the rendezvous of each of
its ranks and which of the sender's ranks sends which KV heads to which of them
(kv_transfer/heads.py). Both workers may be tensor-parallel groups of any sizes the
model splits into; two of one rank each make one route of every head, sent whole."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.parallel.sharding import kv_head_range
from pdserve.kv_transfer.heads import HeadRoute, head_routes


@dataclass(frozen=True)
class Destination:
    addresses: tuple[str, ...]  # its ranks' KV rendezvous, rank 0's first
    routes: tuple[HeadRoute, ...]
    src_kv_heads: int  # the KV heads each sending rank holds
    dst_kv_heads: int  # and each receiving rank

    @classmethod
    def of(cls, addresses: list[str], num_heads: int, num_kv_heads: int,
           src_size: int) -> "Destination":
        dst_size = len(addresses)
        return cls(addresses=tuple(addresses),
                   routes=tuple(head_routes(num_heads, num_kv_heads, src_size, dst_size)),
                   src_kv_heads=kv_head_range(num_heads, num_kv_heads, src_size, 0)[1],
                   dst_kv_heads=kv_head_range(num_heads, num_kv_heads, dst_size, 0)[1])

    def heads(self, route: HeadRoute) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The route's (sent, received) head slices; (None, None) when it moves every
        head of both ranks (the transfer of two one-rank workers, as before)."""
        if route.src_heads == (0, self.src_kv_heads) and \
                route.dst_heads == (0, self.dst_kv_heads):
            return None, None
        return route.src_heads, route.dst_heads

    def addresses_from(self, rank: int) -> list[str]:
        """The receiving ranks the sending `rank` has routes to."""
        return list(dict.fromkeys(self.addresses[r.dst_rank] for r in self.routes
                                  if r.src_rank == rank))

    def senders(self) -> list[int]:
        """The sending ranks other than 0 with a route."""
        return sorted({r.src_rank for r in self.routes} - {0})
