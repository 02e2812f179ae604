"""The proposer speculative decoding runs: what engine/spec_decode/config.py names."""
from __future__ import annotations

from typing import Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Draft tokens for requests one token behind (request id -> drafts; none for
        a request is fine)."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: what is kept of it goes."""

    def bytes_per_block(self) -> int:
        """KV bytes it keeps per KV block of the target's."""

    def init_kv_cache(self, num_blocks: int) -> None:
        """Called once the engine sized its KV cache."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Its KV of each (source, destination) block copied (copy-on-write of a block
        the choices of one prompt share: KVCopies.within), before it proposes again."""


def build_proposer(config: EngineConfig, target: ModelConfig,
                   max_model_len: int) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from pdserve.engine.spec_decode.ngram import NgramProposer
        return NgramProposer(spec)
    from pdserve.engine.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(config, target, max_model_len)
