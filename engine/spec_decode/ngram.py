"""Prompt lookup (n-gram) proposals: the tokens that followed the earliest earlier
occurrence of the request's last n tokens, for the longest n from prompt_lookup_max
down to prompt_lookup_min that occurred before. Pure Python.

Each request's n-grams are indexed as its tokens arrive (n-gram -> where its first
occurrence ended), so a proposal costs a few dictionary lookups however long the
request is: no per-step scan of the whole sequence."""
from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.engine.spec_decode.config import SpeculativeConfig


class _Index:
    __slots__ = ("first_end", "num_indexed")

    def __init__(self):
        self.first_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its first occurrence
        self.num_indexed = 0  # n-grams ending at positions up to here are in first_end


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Drafts for requests one token behind (their next step verifies them);
        requests with no earlier match, or no room left before max_tokens, get none."""
        drafts = {}
        for request in requests:
            room = min(self.k, request.max_num_tokens - request.num_tokens - 1)
            if room > 0:
                found = self._lookup(request, room)
                if found:
                    drafts[request.request_id] = found
        return drafts

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def bytes_per_block(self) -> int:
        return 0  # no KV of its own

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # no KV of its own

    def _lookup(self, request: Request, room: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index()
        end = request.num_tokens
        self._extend(index, request, end - 1)  # not the suffix itself: it would find itself
        for n in self.sizes:
            if n <= end:
                first = index.first_end.get(tuple(request.token_ids(end - n, end)))
                if first is not None:
                    return request.token_ids(first, min(first + room, end))
        return []

    def _extend(self, index: _Index, request: Request, upto: int) -> None:
        """Index the n-grams that end at positions num_indexed + 1 .. upto."""
        start = index.num_indexed
        if upto <= start:
            return
        lo = max(start + 1 - self.sizes.start, 0)
        window = request.token_ids(lo, upto)  # every token those n-grams cover
        first_end = index.first_end
        for stop in range(start + 1, upto + 1):
            for n in self.sizes:
                if n <= stop:
                    first_end.setdefault(tuple(window[stop - n - lo:stop - lo]), stop)
        index.num_indexed = upto
