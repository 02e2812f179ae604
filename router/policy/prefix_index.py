"""Which workers hold which prefix blocks: an index block hash -> workers, kept from
the prefix-cache events in each worker's telemetry (blocks made findable, blocks
evicted). The policy asks it how many leading blocks of a prompt each worker would
find in its cache. Hashes are the block manager's chained hashes, so a block's
hash names its whole prefix and a hit on block i implies the prompt up to it."""
from __future__ import annotations

from pdserve.engine.block_manager import hash_block


class PrefixIndex:
    def __init__(self) -> None:
        # A hash's holder: its one worker's id (the common case: no set of one, about
        # 220 bytes a block at the millions of blocks of a large cluster's caches), or
        # the set of two or more.
        self._holders: dict[bytes, str | set[str]] = {}
        self._held: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def update(self, worker_id: str, stored: tuple[bytes, ...],
               evicted: tuple[bytes, ...]) -> None:
        """One report's net change (WorkerTelemetry: no hash both stored and evicted)."""
        holders = self._holders
        held = self._held.setdefault(worker_id, set())
        for h in stored:
            found = holders.get(h)
            if found is None:
                holders[h] = worker_id
            elif isinstance(found, set):
                found.add(worker_id)
            elif found != worker_id:
                holders[h] = {found, worker_id}
            held.add(h)
        for h in evicted:
            held.discard(h)
            found = holders.get(h)
            if found is None:
                continue
            if not isinstance(found, set):
                if found == worker_id:
                    del holders[h]
                continue
            found.discard(worker_id)
            if len(found) == 1:
                holders[h] = next(iter(found))

    def forget(self, worker_id: str) -> None:
        """The worker left, or restarted with an empty cache."""
        self.update(worker_id, (), tuple(self._held.pop(worker_id, ())))
        self._held.pop(worker_id, None)

    def hits(self, hashes: list[bytes]) -> dict[str, int]:
        """Worker id -> leading blocks of the prompt (hashes in order) it holds; workers
        with none are left out."""
        found: dict[str, int] = {}
        holders = self._holders
        alive: set[str] | None = None  # the workers holding every block so far
        for i, h in enumerate(hashes):
            held = holders.get(h)
            if held is None:
                break
            if alive is None:
                alive = set(held) if isinstance(held, set) else {held}
            elif isinstance(held, set):
                alive &= held
            elif held not in alive:
                break
            elif len(alive) > 1:
                alive = {held}
            if not alive:
                break
            for worker_id in alive:
                found[worker_id] = i + 1
        return found


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks that a worker could hit (the
    last token is always computed, as the block manager counts hits)."""
    hashes: list[bytes] = []
    for i in range((len(token_ids) - 1) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else b"",
                                 token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
