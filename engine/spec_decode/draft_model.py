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
tokens is written over the next time."""
from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import bytes_per_block
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
        self.runner = ModelRunner(replace(config, model=model_dir, speculative_config=None),
                                  self.model_config, max_model_len)
        self.k = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self._computed: dict[str, int] = {}  # request id -> tokens whose KV it holds

    def bytes_per_block(self) -> int:
        return bytes_per_block(self.model_config, self.block_size, self.runner.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

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
        drafts = {r.request_id: [] for r, _ in plans}
        self._catch_up(plans, drafts)
        for i in range(1, max(w for _, w in plans)):
            going = [(r, w) for r, w in plans if w > i]
            decodes = [(drafts[r.request_id][-1], r.num_tokens + i - 1, r.block_ids)
                       for r, _ in going]
            for (r, _), token in zip(going, self._argmax(decodes, [])):
                drafts[r.request_id].append(token)
        return drafts

    def _catch_up(self, plans: list[tuple[Request, int]], drafts: dict[str, list[int]]) -> None:
        """Its KV up to each request's last token; the first guess of each."""
        decodes, chunks, order = [], [], ([], [])
        for r, _ in plans:
            done = min(self._computed.get(r.request_id, 0), r.num_tokens - 1)
            if done == r.num_tokens - 1:  # one new token: a decode
                decodes.append((r.token_at(done), done, r.block_ids))
                order[0].append(r)
            else:
                chunks.append((r.token_ids(done, r.num_tokens), done, r.block_ids))
                order[1].append(r)
            self._computed[r.request_id] = r.num_tokens
        for r, token in zip(order[0] + order[1], self._argmax(decodes, chunks)):
            drafts[r.request_id].append(token)

    def _argmax(self, decodes, chunks) -> list[int]:
        # logits: [len(decodes) + len(chunks), vocab]
        return self.runner.forward_tokens(decodes, chunks).argmax(dim=-1).tolist()
