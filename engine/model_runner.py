"""Runs one scheduled step on the device: flat inputs, model forward, sampling.

A sampling batch that raises is sampled again row by row, so the requests whose own
rows fail are the only ones to fail (ModelRunnerOutput.failed). An error no single
row reproduces, or one in the forward pass, belongs to the step: it propagates."""
from __future__ import annotations

import logging

import torch

from pdserve.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment, TorchAttention
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import allocate_kv_cache
from pdserve.engine.model.llama import LayerHook
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, Verified

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Decodes are attended in groups of similar context length, so padding stays small.
DECODE_GROUP_SIZE = 32
log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.resolved_dtype]
        self.model_config = model_config
        self.model = load_model(config.model, model_config, self.device, self.dtype)
        self.rope = RotaryEmbedding(model_config, max_model_len, self.device, self.dtype)
        self.backend = TorchAttention(model_config.num_heads, model_config.num_kv_heads,
                                      model_config.head_dim)
        self.block_size = config.cache.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler(config.seed)

    def init_kv_cache(self, num_blocks: int) -> None:
        """After the weights are in place, so a device budget counts what is left."""
        self.kv_caches = allocate_kv_cache(self.model_config, num_blocks, self.block_size,
                                           self.device, self.dtype)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_layer_done: LayerHook | None = None
                ) -> ModelRunnerOutput:
        batch, samplers, verifiers = self._order(out)
        logits = self.forward_logits(batch, samplers, on_layer_done, out.spec_token_ids)
        result = ModelRunnerOutput()
        if verifiers:
            self._verify(logits[len(samplers):], verifiers, out.spec_token_ids, result)
            logits = logits[:len(samplers)]
        if not samplers:
            return result
        try:
            rows = list(zip(samplers, *self.sampler.sample(logits, samplers)))
        except Exception as batch_error:
            rows = self._sample_each(logits, samplers, batch_error, result.failed)
        for request, token, logprob, top in rows:
            rid = request.request_id
            result.sampled_token_ids[rid] = token
            if logprob is not None:
                result.logprobs[rid] = logprob
            if top is not None:
                result.top_logprobs[rid] = top
        return result

    def _verify(self, logits: torch.Tensor, verifiers: list[Request],
                drafts: dict[str, list[int]], result: ModelRunnerOutput) -> None:
        """logits: [sum(len(drafts) + 1), vocab], each verifier's rows in turn. A
        request whose own verification raises fails alone."""
        argmax = logits.argmax(dim=-1).tolist()  # the greedy rows' tokens, in one call
        row = 0
        for request in verifiers:
            rid = request.request_id
            own = drafts[rid]
            end = row + len(own) + 1
            try:
                tokens, logprobs, tops = self.sampler.verify(logits[row:end], request, own,
                                                             argmax[row:end])
            except Exception as exc:
                log.exception("verifying drafts failed for request %s", rid)
                result.failed[rid] = f"sampling failed: {type(exc).__name__}: {exc}"[:200]
            else:
                result.verified[rid] = Verified(token_ids=tokens, num_accepted=len(tokens) - 1,
                                                logprobs=logprobs, top_logprobs=tops)
            row = end

    def _sample_each(self, logits: torch.Tensor, samplers: list[Request],
                     batch_error: Exception, failed: dict[str, str]) -> list[tuple]:
        """The batch failed to sample: each row alone, recording the rows that fail.
        None failing alone, or all of several, means the error is not one request's:
        re-raised."""
        rows = []
        for i, request in enumerate(samplers):
            try:
                rows.append((request, *(column[0] for column in
                                        self.sampler.sample(logits[i:i + 1], [request]))))
            except Exception as exc:
                log.exception("sampling failed for request %s alone", request.request_id)
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                failed[request.request_id] = f"sampling failed: {type(exc).__name__}: {first}"
        if not failed or (len(failed) == len(samplers) > 1):
            failed.clear()  # no row, or every row: not one request's doing
            raise batch_error
        return rows

    @torch.inference_mode()
    def forward_logits(self, batch: list[tuple[Request, int]], samplers: list[Request],
                       on_layer_done: LayerHook | None = None,
                       drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """Computes `batch` (decodes first); logits [len(samplers), vocab] float32, then
        every position of each request verifying `drafts` (rid -> its drafts)."""
        input_ids, positions, meta, logits_indices = self._prepare(batch, drafts or {})
        hidden = self.model(input_ids, positions, self.rope, self.backend, self.kv_caches,
                            meta, on_layer_done)
        return self.model.compute_logits(hidden[logits_indices])

    def _order(self, out: SchedulerOutput):
        """The batch as computed (decodes by context length, verifications, prompt
        chunks), the requests sampling one token, those verifying drafts."""
        decodes, verifications, prefills = [], [], []
        drafts = out.spec_token_ids
        for request, n in zip(out.requests, out.num_scheduled):
            if n == 1:
                decodes.append((request, n))
            elif drafts and request.request_id in drafts:
                verifications.append((request, n))
            else:
                prefills.append((request, n))
        decodes.sort(key=lambda item: item[0].num_computed_tokens)
        batch = decodes + verifications + prefills
        samplers = [r for r, n in decodes + prefills if r.num_computed_tokens + n == r.num_tokens]
        return batch, samplers, [r for r, _ in verifications]

    def _prepare(self, batch: list[tuple[Request, int]], drafts: dict[str, list[int]]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        num_decodes = 0
        for request, n in batch:
            if n != 1:
                break
            pos = request.num_computed_tokens
            input_ids.append(request.token_at(pos))
            positions.append(pos)
            slots.append(request.block_ids[pos // bs] * bs + pos % bs)
            if pos + 1 == request.num_tokens:
                logits_indices.append(num_decodes)
            num_decodes += 1
        prefills, verify_indices = [], []
        for request, n in batch[num_decodes:]:
            start = request.num_computed_tokens
            blocks = request.block_ids
            prefills.append(PrefillSegment(len(input_ids), n, start + n,
                                           torch.tensor(blocks, device=self.device)))
            own = drafts.get(request.request_id)
            if own:  # its last known token, then the drafts: logits at every position
                verify_indices.extend(range(len(input_ids), len(input_ids) + n))
                input_ids.append(request.token_at(start))
                input_ids.extend(own)
            else:
                input_ids.extend(request.token_ids(start, start + n))
                if start + n == request.num_tokens:
                    logits_indices.append(len(input_ids) - 1)
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
        logits_indices += verify_indices
        decodes = [r for r, _ in batch[:num_decodes]]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), num_decode_tokens=num_decodes,
            decode_groups=self._decode_groups([r.num_computed_tokens + 1 for r in decodes],
                                              [r.block_ids for r in decodes]),
            prefills=prefills)
        return (self._tensor(input_ids), self._tensor(positions), meta,
                self._tensor(logits_indices))

    @torch.inference_mode()
    def forward_tokens(self, decodes: list[tuple[int, int, list[int]]],
                       chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """A forward pass over tokens given directly (a draft model's): decodes are
        (token, position, block ids), chunks (tokens, first position, block ids), each
        after the KV already in its blocks. Logits [len(decodes) + len(chunks), vocab]:
        after each decode token, then after each chunk's last token."""
        bs = self.block_size
        input_ids = [token for token, _, _ in decodes]
        positions = [pos for _, pos, _ in decodes]
        slots = [blocks[pos // bs] * bs + pos % bs for _, pos, blocks in decodes]
        logits_indices = list(range(len(decodes)))
        prefills = []
        for tokens, start, blocks in chunks:
            n = len(tokens)
            prefills.append(PrefillSegment(len(input_ids), n, start + n,
                                           torch.tensor(blocks, device=self.device)))
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            logits_indices.append(len(input_ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), num_decode_tokens=len(decodes),
            decode_groups=self._decode_groups([pos + 1 for _, pos, _ in decodes],
                                              [blocks for _, _, blocks in decodes]),
            prefills=prefills)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.rope,
                            self.backend, self.kv_caches, meta)
        return self.model.compute_logits(hidden[self._tensor(logits_indices)])

    def _decode_groups(self, contexts: list[int], tables: list[list[int]]) -> list[DecodeGroup]:
        """Decodes in groups of DECODE_GROUP_SIZE: each one's context length (its KV
        including the token it computes) and block ids."""
        bs = self.block_size
        groups = []
        for start in range(0, len(contexts), DECODE_GROUP_SIZE):
            context = contexts[start:start + DECODE_GROUP_SIZE]
            width = -(-max(context) // bs)
            table = [blocks[:width] + [0] * (width - len(blocks[:width]))
                     for blocks in tables[start:start + DECODE_GROUP_SIZE]]
            lens = self._tensor(context)
            mask = torch.arange(width * bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
            groups.append(DecodeGroup(start, self._tensor(table), mask[:, None, None, :]))
        return groups

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
