"""Draft-model proposals: a smaller model sharing the target's tokenizer guesses k
tokens per request per step, greedily (its argmax: deterministic drafts, so
rejection_sampler.verify keeps the target's distribution and seeded draws).

Its KV lives in a cache of its own under the target's block ids: a request's blocks
hold both models' KV for its tokens, and the scheduler's lookahead slots (k past the
verified tokens) take the draft's KV for its own guesses. Each step it first catches
up on the tokens the request gained since it last ran (after a verification, the
accepted drafts and the token after them; its whole prompt the first time, computed
here, on the worker that decodes it, whether the target's KV for that prompt was
computed here or sent by a prefill worker), which yields its first guess; then k - 1
decode passes over the whole batch give the rest. What it computed past the verified
tokens is written over the next time.

In a disaggregated cluster the draft's KV for a prompt is computed on the decode
worker rather than sent with the target's: the draft's pass over a prompt costs a
fraction of the target's and runs where that KV is read, while sending it would load
the draft on every prefill worker, put a second layout on the wire and lengthen the
transfer each request waits for. A request that hits the prefix cache still has the
draft catch up from its first token (the draft's KV in a cached block may never have
been computed: the block may have been filled by a transfer)."""
from __future__ import annotations

from dataclasses import replace

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import bytes_per_block, copy_blocks
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_path import resolve_model_path
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, max_model_len: int):
        spec = config.speculative_config
        model_dir = str(resolve_model_path(spec.model))
        self.model_config = ModelConfig.from_dir(model_dir)
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model_config.vocab_size}) "
                             f"is not the target's ({target.vocab_size}): they must share "
                             "the tokenizer")
        # It runs forward_tokens only, never the decode steps CUDA graphs replay.
        self.runner = ModelRunner(replace(config, model=model_dir, speculative_config=None,
                                          enforce_eager=True),
                                  self.model_config, max_model_len)
        self.k = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self._computed: dict[str, int] = {}  # request id -> tokens whose KV it holds

    def bytes_per_block(self) -> int:
        return bytes_per_block(self.model_config, self.block_size, self.runner.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(self.runner.kv_caches, pairs)

    def forget(self, request_id: str) -> None:
        """Finished, or preempted (its blocks, and the KV there, are gone)."""
        self._computed.pop(request_id, None)

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Drafts for requests one token behind, as many as k, max_tokens and the KV
        slots they hold allow (its guesses' KV goes into the slots after the tokens)."""
        bs = self.block_size
        plans = []  # (request, drafts wanted)
        for r in requests:
            wanted = min(self.k, r.max_num_tokens - r.num_tokens - 1,
                         len(r.block_ids) * bs - r.num_tokens + 1)
            if wanted > 0:
                plans.append((r, wanted))
        if not plans:
            return {}
        # Catch up on each request's new tokens: its first guess.
        chunks = []
        for r, _ in plans:
            done = min(self._computed.get(r.request_id, 0), r.num_tokens - 1)
            chunks.append((r.token_ids(done, r.num_tokens), done, r.block_ids))
            self._computed[r.request_id] = r.num_tokens
        drafts = {r.request_id: [token] for (r, _), token in zip(plans, self._argmax(chunks))}
        for i in range(1, max(w for _, w in plans)):  # the rest: one decode pass each
            going = [r for r, w in plans if w > i]
            guesses = self._argmax([([drafts[r.request_id][-1]], r.num_tokens + i - 1,
                                     r.block_ids) for r in going])
            for r, token in zip(going, guesses):
                drafts[r.request_id].append(token)
        return drafts

    def _argmax(self, chunks) -> list[int]:
        # logits: [len(chunks), vocab]
        return self.runner.forward_tokens(chunks).argmax(dim=-1).tolist()
