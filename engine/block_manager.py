"""Paged KV block accounting: reference counts, prefix caching, LRU reuse.

Pure Python: it hands out block ids and never touches tensors. A full block is
identified by a chained hash (parent hash + the block's token ids). Freed blocks that
carry a hash stay findable until the LRU free queue hands them out again.

The choices of a request for n > 1 sequences share its prompt's blocks (fork), the
last partly filled one copied when one of them first writes into it (own_tail).

With host memory (engine/host_pool.py) it also names the copies between the tiers a
step runs before its forward pass (KVCopies): a preempted request's blocks swapped
out and back in, every full block as it is cached stored in the host prefix tier,
and a prefix found there loaded into new device blocks. Each copy pins its blocks
(device and host) until the copies of the step that took it ran: a block pinned is
neither free nor evicted, so a reservation made from another thread meanwhile (the
decode role's) can never be handed one a copy still reads or writes.
"""
from __future__ import annotations

import functools
import struct
from collections import OrderedDict

import xxhash

from pdserve.engine.host_pool import HostBlockPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import KVCopies


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold num_tokens tokens' KV (the last one partly filled)."""
    return -(-num_tokens // block_size)


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The chained hash of a block: its parent's hash and its token ids (as int64),
    128-bit XXH3 (vLLM's `xxhash` choice: a non-cryptographic hash is enough because a
    cache hit is served only when the block's token ids also match; blake2b cost 1.2 us
    a block against 0.15 us, a block per request every 16 decode steps)."""
    return _xxh3_128(parent + pack_tokens(token_ids))


def pack_tokens(token_ids: list[int]) -> bytes:
    """Token ids as int64 bytes: what a block's hash covers, and what a cached block
    keeps to check a hit against (16 tokens in 161 bytes; a tuple of them kept its
    ints alive too, about 700 bytes a block once its request ended)."""
    return _packer(len(token_ids))(*token_ids)


_xxh3_128 = xxhash.xxh3_128_digest


@functools.cache
def _packer(num_tokens: int):
    """Packs that many token ids as int64 (a third faster than array(...).tobytes())."""
    return struct.Struct(f"{num_tokens}q").pack


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.tokens = b""  # pack_tokens of its token ids, while it is findable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host: HostBlockPool | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A block's state, made when first handed out (a large pool is cheap to build).
        self.blocks: list[KVBlock | None] = [None] * num_blocks
        # Free blocks are handed out in LRU order: first those never used (ids
        # _fresh..num_blocks-1, in order), then freed ones, least recently freed first.
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()  # freed, ref_cnt == 0
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # A request's block ids live on `request.block_ids`, in token order.
        self._num_hashed: dict[str, int] = {}  # request id -> leading blocks registered
        # Prefix-cache events since take_prefix_events(), kept only when asked for (a
        # worker reports them so routers can index which worker holds which prefix).
        self._prefix_events: list[tuple[bytes, bool]] = []  # (hash, stored: else evicted)
        # Host memory: the swap area and the prefix tier (None: neither). Copies named
        # since the last take_copies() and the blocks they pin (device, host); those
        # the last taken copies pin, released by release_copies().
        self.host = host
        self._prefix_tier = host is not None and host.num_prefix_blocks > 0 \
            and enable_prefix_caching
        self.record_prefix_events = False
        self._copies = KVCopies()
        self._pending: tuple[list[int], list[int]] = ([], [])
        self._in_flight: tuple[list[int], list[int]] = ([], [])
        self._swapped_from: list[int] = []  # device blocks swapped out, copies pending
        # Device blocks that copies not yet taken fill (a swap-in, host hits loaded):
        # never swapped out before they are filled.
        self.loading: set[int] = set()
        # Shared blocks a copy-on-write reads, pinned until it ran: block -> pins.
        self._copy_sources: dict[int, int] = {}
        # Tensor parallelism: the other ranks run the copies too, in order before the
        # next forward pass, so copies are released only after one (engine.py).
        self.copies_on_other_ranks = False

    @property
    def record_prefix_events(self) -> bool:
        """Whether prefix-cache events are kept (both tiers'): a worker reports them
        so routers can index which worker holds which prefix, in which tier."""
        return self._record

    @record_prefix_events.setter
    def record_prefix_events(self, on: bool) -> None:
        self._record = on
        if self.host is not None:
            self.host.record_events = on

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading full blocks of `request` already in the cache (at least one token
        is always left to compute, so the step still yields logits). None for a
        request asking for prompt logprobs: its prompt is computed whole."""
        if not self.enable_prefix_caching or request.scores_prompt:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(request.block_hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            start = i * self.block_size
            if block.tokens != pack_tokens(request.token_ids(start, start + self.block_size)):
                break  # a hash collision: never serve another prompt's KV
            hits.append(block_id)
        return hits

    def get_host_hits(self, request: Request, num_device_hits: int) -> list[int]:
        """The host prefix tier's blocks continuing the request's leading device hits
        (get_computed_blocks'), as far as they match."""
        if not self._prefix_tier or request.scores_prompt:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)  # (get_computed_blocks' already, as a rule)
        bs, hashes, lookup = self.block_size, request.block_hashes, self.host.lookup
        hits: list[int] = []
        for i in range(num_device_hits, max_blocks):
            host_id = lookup(hashes[i], pack_tokens(request.token_ids(i * bs, (i + 1) * bs)))
            if host_id is None:
                break
            hits.append(host_id)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[int] = ()) -> bool:
        return self._num_new_blocks(request, num_new_tokens, new_computed_blocks) <= (
            self.num_free_blocks - sum(1 for b in new_computed_blocks if b in self._free))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] = (), host_hits: list[int] = ()) -> bool:
        """Blocks for `num_new_tokens` more tokens after the computed ones; False (and
        nothing changed) when the pool lacks room. host_hits (a new request's, after
        its device hits new_computed_blocks): host prefix-tier blocks loaded into the
        new blocks that follow, before the step's forward pass."""
        loaded = len(host_hits) * self.block_size
        if not self.can_allocate(request, num_new_tokens + loaded, new_computed_blocks):
            return False
        owned = request.block_ids
        num_new = self._num_new_blocks(request, num_new_tokens + loaded, new_computed_blocks)
        for block_id in new_computed_blocks:
            self._touch(block_id)
        owned.extend(new_computed_blocks)
        if new_computed_blocks:
            self._num_hashed[request.request_id] = len(owned)
        start = len(owned)
        owned.extend(self._pop_free() for _ in range(num_new))
        if host_hits:
            self._load(host_hits, owned[start:start + len(host_hits)])
        return True

    # ---- host memory: copies between the tiers ------------------------------------

    def swap_out(self, request: Request) -> bool:
        """A preempted request's computed blocks copied to the host swap area, its
        device blocks freed (`request.host_block_ids` says where they went). False,
        nothing changed, when the area lacks room."""
        num = blocks_for(request.num_computed_tokens, self.block_size)
        host_ids = self.host.allocate_swap(num) if self.host is not None else None
        if host_ids is None:
            return False
        self._copies.to_host.extend(zip(request.block_ids, host_ids))
        self._pending[1].extend(host_ids)
        self._swapped_from.extend(request.block_ids[:num])
        self.free(request)
        request.host_block_ids = host_ids
        return True

    # ---- parallel sampling: blocks shared by the choices of one prompt --------------

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """The child (a choice of the parent's prompt, forked at its first token)
        shares the blocks holding the first num_tokens tokens' KV: reference counts,
        no copy. A last, partly filled block is shared too until one of them writes
        into it (own_tail copies it first: copy-on-write)."""
        bs, blocks = self.block_size, self.blocks
        shared = parent.block_ids[:blocks_for(num_tokens, bs)]
        for block_id in shared:
            blocks[block_id].ref_cnt += 1
        child.block_ids = list(shared)
        full = num_tokens // bs
        child.block_hashes = parent.block_hashes[:full]
        hashed = self._num_hashed.get(parent.request_id)
        if hashed is not None:
            self._num_hashed[child.request_id] = min(hashed, full)
        if num_tokens % bs:
            parent.shared_tail = child.shared_tail = True

    def own_tail(self, request: Request) -> bool:
        """Copy-on-write, before the request writes into its last, partly filled
        block: while another request shares it, a free block takes a copy of it
        (before the step's forward pass) and replaces it in this request's blocks.
        False (nothing changed) when no block is free."""
        i = request.num_computed_tokens // self.block_size
        shared_id = request.block_ids[i]
        pins = self._copy_sources.get(shared_id, 0)  # (references that are copies. pins)
        if self.blocks[shared_id].ref_cnt - pins > 1:
            if not self.num_free_blocks:
                return False
            own = self._pop_free()
            self._copies.within.append((shared_id, own))
            # its reference now pins the shared block until the copy ran; the copy
            # runs after the step's swap-outs (one may read the block it fills) and
            # fills a block no swap-out of this step may read (loading)
            self._pending[0].append(shared_id)
            self._copy_sources[shared_id] = pins + 1
            self._touch(own)  # and the block it fills, until then
            self._pending[0].append(own)
            self.loading.add(own)
            request.block_ids[i] = own
        request.shared_tail = False
        return True

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request.num_computed_tokens + num_new_tokens) \
            <= self.num_free_blocks
        # (an upper bound: blocks the device still caches are reused, not copied)

    def swap_in(self, request: Request, num_new_tokens: int) -> int:
        """A swapped request's blocks back on the device, with room for its next
        `num_new_tokens`: the leading ones the device still caches are taken from
        there, the rest copied back. The blocks copied, or -1 (nothing changed) when
        the pool lacks room."""
        if not self.can_swap_in(request, num_new_tokens):
            return -1
        host_ids, request.host_block_ids = request.host_block_ids, []
        # Only whole computed blocks: a partly computed one is written again here, and
        # a cached block another request holds is never written.
        hits = self.get_computed_blocks(request)[:request.num_computed_tokens // self.block_size]
        computed, request.num_computed_tokens = request.num_computed_tokens, 0
        allocated = self.allocate_slots(
            request, computed + num_new_tokens - len(hits) * self.block_size, hits)
        request.num_computed_tokens = computed
        assert allocated, "can_swap_in bounds what allocate_slots takes"
        copied = host_ids[len(hits):]
        self._load(copied, request.block_ids[len(hits):len(host_ids)])
        self.host.free_swap(host_ids)  # (the copied ones once their copies ran)
        # Its blocks are made findable by the scheduler's update, once copied back.
        return len(copied)

    def take_copies(self) -> KVCopies | None:
        """The copies named since the last call, for the step being scheduled (their
        blocks stay pinned until release_copies(), after that step's copies ran)."""
        copies = self._copies
        if not copies:
            return None
        # A swapped-out block this step did not hand out again waits for its copy:
        # nobody else (another thread's reservation) gets it before then.
        for block_id in self._swapped_from:
            if self.blocks[block_id].ref_cnt == 0:
                self._touch(block_id)
                self._pending[0].append(block_id)
        self._swapped_from = []
        self._copies = KVCopies()
        self._in_flight[0].extend(self._pending[0])
        self._in_flight[1].extend(self._pending[1])
        self._pending = ([], [])
        self.loading = set()
        return copies

    def release_copies(self) -> None:
        """The copies taken so far ran (on every rank: after a forward pass that
        every rank reaches after them): their blocks are unpinned."""
        devices, hosts = self._in_flight
        if not (devices or hosts):
            return
        self._in_flight = ([], [])
        blocks, free, sources = self.blocks, self._free, self._copy_sources
        for block_id in devices:
            if sources and block_id in sources:
                sources[block_id] -= 1
                if not sources[block_id]:
                    del sources[block_id]
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block_id] = None
        if hosts:
            self.host.release(hosts)

    @property
    def has_copies(self) -> bool:
        return bool(self._copies)

    def _store(self, block: KVBlock) -> None:
        """Write-through: a block just cached on the device, stored in the host tier."""
        host_id = self.host.store(block.block_hash, block.tokens)
        if host_id is None:
            return  # held there already, or every host block is in flight
        self._touch(block.block_id)
        self._pending[0].append(block.block_id)
        self._pending[1].append(host_id)
        self._copies.to_host.append((block.block_id, host_id))

    def _load(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Host blocks copied into device blocks before the next forward pass: both
        pinned until then, the device blocks never swapped out before they are filled."""
        to_device, pins = self._copies.to_device, self._pending
        for host_id, device_id in zip(host_ids, device_ids):
            to_device.append((host_id, device_id))
            self._touch(device_id)
            pins[0].append(device_id)
            self.loading.add(device_id)
        self.host.pin(host_ids)
        pins[1].extend(host_ids)

    def append_block(self, request: Request) -> bool:
        """One more block at the end of the request's (a decode step crossing into a
        new block: allocate_slots' common case without its general arithmetic);
        False when none is free."""
        if self._fresh < self.num_blocks:
            block_id, self._fresh = self._fresh, self._fresh + 1
            block = self.blocks[block_id] = KVBlock(block_id)
            block.ref_cnt = 1
        elif self._free:
            block_id = self._pop_free()
        else:
            return False
        request.block_ids.append(block_id)
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full, computed blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        owned = request.block_ids
        num_full = min(num_computed_tokens // self.block_size, len(owned))
        start = self._num_hashed.get(rid, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, start)  # the chain up to here (known already, as a rule)
        hashes, bs, cached = request.block_hashes, self.block_size, self._cached
        for i in range(start, num_full):
            # hashed and kept: packed once
            packed = pack_tokens(request.token_ids(i * bs, (i + 1) * bs))
            if i < len(hashes):
                block_hash = hashes[i]
            else:  # the chain grows by this block (_extend_hashes, for one)
                block_hash = _xxh3_128((hashes[i - 1] if i else b"") + packed)
                hashes.append(block_hash)
            if block_hash in cached:
                continue  # an identical block computed concurrently already serves hits
            block = self.blocks[owned[i]]
            block.block_hash = block_hash
            block.tokens = packed
            cached[block_hash] = block.block_id
            if self._record:
                self._prefix_events.append((block_hash, True))
            if self._prefix_tier:
                self._store(block)
        self._num_hashed[rid] = num_full

    def cache_decoded_blocks(self, requests: list[Request]) -> None:
        """cache_full_blocks for requests whose last step (a decode) completed a
        block: in one loop, each adding one hash to a chain known up to there (a
        decode step's common case); the rest take the general way."""
        if not self.enable_prefix_caching:
            return
        bs, blocks, cached = self.block_size, self.blocks, self._cached
        num_hashed = self._num_hashed
        for request in requests:
            computed, hashes, rid = request.num_computed_tokens, request.block_hashes, \
                request.request_id
            i = computed // bs - 1  # the block completed
            first = i * bs - len(request.prompt_token_ids)
            if first < 0 or len(hashes) != i or num_hashed.get(rid, 0) != i \
                    or i >= len(request.block_ids):
                self.cache_full_blocks(request, computed)
                continue
            packed = pack_tokens(request.output_token_ids[first:first + bs])
            block_hash = _xxh3_128((hashes[-1] if i else b"") + packed)
            hashes.append(block_hash)
            num_hashed[rid] = i + 1
            if block_hash in cached:
                continue  # an identical block computed concurrently already serves hits
            block = blocks[request.block_ids[i]]
            block.block_hash, block.tokens = block_hash, packed
            cached[block_hash] = block.block_id
            if self._record:
                self._prefix_events.append((block_hash, True))
            if self._prefix_tier:
                self._store(block)

    def free(self, request: Request) -> None:
        # Tail blocks go first in the LRU queue: a prefix is more likely shared.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
        request.block_ids = []
        request.shared_tail = False
        self._num_hashed.pop(request.request_id, None)
        if request.host_block_ids:  # swapped out: its host copy is dropped
            self.host.free_swap(request.host_block_ids)
            request.host_block_ids = []

    def take_prefix_events(self) -> list[tuple[bytes, bool]]:
        """Since the last call, in order: (hash, True) for a block made findable,
        (hash, False) for one evicted. A hash may be stored again after its eviction
        (worker/messages.py: net_prefix_events keeps each hash's last)."""
        events, self._prefix_events = self._prefix_events, []
        return events

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        new_computed_blocks) -> int:
        have = len(request.block_ids) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        return max(0, self.blocks_needed(total + num_new_tokens) - have)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        if self._fresh < self.num_blocks:
            block_id, self._fresh = self._fresh, self._fresh + 1
            block = self.blocks[block_id] = KVBlock(block_id)
            block.ref_cnt = 1
            return block_id
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self._record:
                    self._prefix_events.append((block.block_hash, False))
            block.block_hash = None
            block.tokens = b""
        block.ref_cnt = 1
        return block_id

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if i else b"",
                                     request.token_ids(i * bs, (i + 1) * bs)))
