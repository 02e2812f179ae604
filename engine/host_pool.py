"""Host-memory KV blocks, accounted: the swap area and the prefix tier. Pure Python,
like the block manager it serves (engine/host_kv_cache.py holds the tensors).

- The swap area (--swap-space) holds a preempted request's computed blocks until it
  resumes (engine/scheduler.py, preemption_mode swap or auto).
- The prefix tier (--kv-offloading-size) holds full blocks under their chained hash,
  least recently used out first. A block is stored as it is computed (write-through,
  as vLLM's offloading connector and LMCache store): its device copy may then be
  evicted at any time, and a later request whose prefix misses on the device finds
  it here and loads it back instead of recomputing it.

Host block ids: the swap area's are 0..num_swap_blocks-1, the prefix tier's follow.
A block a copy of the current step reads or writes is pinned until the step's copies
ran (`release`): never evicted, and never handed out again, before then.
"""
from __future__ import annotations

from collections import OrderedDict


class HostBlockPool:
    def __init__(self, num_swap_blocks: int, num_prefix_blocks: int):
        self.num_swap_blocks = num_swap_blocks
        self.num_prefix_blocks = num_prefix_blocks
        self._swap_free = list(range(num_swap_blocks - 1, -1, -1))  # a stack: low ids first
        self._prefix_free = list(range(num_swap_blocks + num_prefix_blocks - 1,
                                       num_swap_blocks - 1, -1))
        # hash -> host block id, least recently used first; the packed token ids each
        # block holds (a hit is served only when they match: block_manager.py)
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._tokens: dict[int, bytes] = {}
        self._hash_of: dict[int, bytes] = {}
        self._pins: dict[int, int] = {}  # host block -> copies in flight that use it
        self._freed_pinned: set[int] = set()  # swap blocks freed while pinned
        # Since the last take_events(): (hash, True) stored, (hash, False) evicted.
        self.record_events = False
        self._events: list[tuple[bytes, bool]] = []
        self.num_stored = 0  # blocks written into the prefix tier
        self.num_evicted = 0  # of those, dropped for room since
        # What loading one block back to the device takes (the engine measures it;
        # the router prices a host hit with it).
        self.load_s_per_block = 0.0

    @property
    def num_blocks(self) -> int:
        return self.num_swap_blocks + self.num_prefix_blocks

    @property
    def num_used_blocks(self) -> int:
        return (self.num_swap_blocks - len(self._swap_free) - len(self._freed_pinned)
                + len(self._lru))

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._swap_free)

    @property
    def num_prefix_blocks_held(self) -> int:
        return len(self._lru)

    # ---- the swap area ------------------------------------------------------------

    def allocate_swap(self, num: int) -> list[int] | None:
        """`num` swap blocks (pinned: a copy writes them this step), or None when
        fewer are free."""
        if num > len(self._swap_free):
            return None
        ids = [self._swap_free.pop() for _ in range(num)]
        self.pin(ids)
        return ids

    def free_swap(self, ids: list[int]) -> None:
        """Swap blocks back to the area; a pinned one once its copy ran."""
        for host_id in ids:
            if self._pins.get(host_id):
                self._freed_pinned.add(host_id)
            else:
                self._swap_free.append(host_id)

    # ---- the prefix tier ------------------------------------------------------------

    def lookup(self, block_hash: bytes, tokens: bytes) -> int | None:
        """The block holding this hash and these token ids (most recently used now),
        or None."""
        host_id = self._lru.get(block_hash)
        if host_id is None or self._tokens[host_id] != tokens:
            return None
        self._lru.move_to_end(block_hash)
        return host_id

    def store(self, block_hash: bytes, tokens: bytes) -> int | None:
        """Where a block computed on the device is copied to: a host block (pinned),
        or None when one holds it already (now most recently used) or every block of
        the tier is pinned. The least recently used unpinned block makes the room."""
        held = self._lru.get(block_hash)
        if held is not None:
            self._lru.move_to_end(block_hash)
            return None
        if self._prefix_free:
            host_id = self._prefix_free.pop()
        else:
            host_id = self._evict()
            if host_id is None:
                return None
        self._lru[block_hash] = host_id
        self._tokens[host_id] = tokens
        self._hash_of[host_id] = block_hash
        self.pin([host_id])
        self.num_stored += 1
        if self.record_events:
            self._events.append((block_hash, True))
        return host_id

    def _evict(self) -> int | None:
        for block_hash, host_id in self._lru.items():
            if not self._pins.get(host_id):
                del self._lru[block_hash]
                del self._tokens[host_id], self._hash_of[host_id]
                self.num_evicted += 1
                if self.record_events:
                    self._events.append((block_hash, False))
                return host_id
        return None

    def take_events(self) -> list[tuple[bytes, bool]]:
        events, self._events = self._events, []
        return events

    # ---- copies in flight -------------------------------------------------------------

    def pin(self, ids: list[int]) -> None:
        pins = self._pins
        for host_id in ids:
            pins[host_id] = pins.get(host_id, 0) + 1

    def release(self, ids: list[int]) -> None:
        """The copies that pinned these blocks ran."""
        pins = self._pins
        for host_id in ids:
            left = pins[host_id] - 1
            if left:
                pins[host_id] = left
                continue
            del pins[host_id]
            if host_id in self._freed_pinned:
                self._freed_pinned.discard(host_id)
                self._swap_free.append(host_id)
