"""Runs one scheduled step on the device: flat inputs, model forward, sampling.

A sampling batch that raises is sampled again row by row, so the requests whose own
rows fail are the only ones to fail (ModelRunnerOutput.failed). An error no single
row reproduces, or one in the forward pass, belongs to the step: it propagates."""
from __future__ import annotations

import itertools
import logging

import torch

from pdserve.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment, TorchAttention
from pdserve.engine.block_manager import blocks_for
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
# forward_tokens: chunks up to this long are attended in groups (a draft model
# catching up on a verification's tokens); longer ones (a prompt) as prefill chunks.
GROUPED_CHUNK = 16
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
        # Verifications of as many tokens are attended together (decode groups).
        verifications.sort(key=lambda item: (item[1], item[0].num_computed_tokens))
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
        decodes = [r for r, _ in batch[:num_decodes]]
        groups = self._decode_groups([r.num_computed_tokens + 1 for r in decodes],
                                     [r.block_ids for r in decodes])
        verifying = [(r, n) for r, n in batch[num_decodes:] if r.request_id in drafts]
        for request, n in verifying:  # its last known token, then the drafts
            start = request.num_computed_tokens
            input_ids.append(request.token_at(start))
            input_ids.extend(drafts[request.request_id])
            positions.extend(range(start, start + n))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        for n, same in itertools.groupby(verifying, key=lambda item: item[1]):
            same = [r for r, _ in same]
            groups += self._decode_groups([r.num_computed_tokens + n for r in same],
                                          [r.block_ids for r in same],
                                          first=groups[-1].end if groups else 0, query_len=n)
        verify_indices = list(range(num_decodes, len(input_ids)))  # logits at every position
        num_decode_tokens = len(input_ids)
        prefills = []
        for request, n in batch[num_decodes + len(verifying):]:
            start = request.num_computed_tokens
            blocks = request.block_ids
            prefills.append(PrefillSegment(len(input_ids), n, start + n,
                                           torch.tensor(blocks, device=self.device)))
            input_ids.extend(request.token_ids(start, start + n))
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
            if start + n == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots),
                                 num_decode_tokens=num_decode_tokens, decode_groups=groups,
                                 prefills=prefills)
        return (self._tensor(input_ids), self._tensor(positions), meta,
                self._tensor(logits_indices + verify_indices))

    @torch.inference_mode()
    def forward_tokens(self, chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """A forward pass over tokens given directly (a draft model's): each chunk is
        (tokens, first position, block ids), after the KV already in its blocks.
        Logits [len(chunks), vocab], after each chunk's last token. Chunks of up to
        GROUPED_CHUNK tokens are attended in decode groups of equal length (one
        attention call per group, not per chunk), longer ones as prefill chunks."""
        bs = self.block_size
        order = sorted(range(len(chunks)), key=lambda i: (len(chunks[i][0]) > GROUPED_CHUNK,
                                                          len(chunks[i][0])))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last = [0] * len(chunks)  # chunk -> the flat index of its last token
        groups: list[DecodeGroup] = []
        prefills: list[PrefillSegment] = []
        for n, same in itertools.groupby(order, key=lambda i: len(chunks[i][0])):
            same = list(same)
            first = len(input_ids)
            for i in same:
                tokens, start, blocks = chunks[i]
                if n > GROUPED_CHUNK:
                    prefills.append(PrefillSegment(len(input_ids), n, start + n,
                                                   torch.tensor(blocks, device=self.device)))
                input_ids.extend(tokens)
                positions.extend(range(start, start + n))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
                last[i] = len(input_ids) - 1
            if n <= GROUPED_CHUNK:
                groups += self._decode_groups([chunks[i][1] + n for i in same],
                                              [chunks[i][2] for i in same], first, n)
        num_grouped = groups[-1].end if groups else 0
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decode_tokens=num_grouped,
                                 decode_groups=groups, prefills=prefills)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.rope,
                            self.backend, self.kv_caches, meta)
        return self.model.compute_logits(hidden[self._tensor(last)])

    def _decode_groups(self, contexts: list[int], tables: list[list[int]], first: int = 0,
                       query_len: int = 1) -> list[DecodeGroup]:
        """Requests computing `query_len` tokens each (their tokens from `first` in the
        flat batch, request after request), in groups of DECODE_GROUP_SIZE: each one's
        context length (its KV including the tokens it computes) and block ids."""
        bs, size = self.block_size, DECODE_GROUP_SIZE
        groups = []
        for i in range(0, len(contexts), size):
            context = contexts[i:i + size]
            width = blocks_for(max(context), bs)
            table = [blocks[:width] + [0] * (width - len(blocks[:width]))
                     for blocks in tables[i:i + size]]
            lens = self._tensor(context)  # [B]
            keys = torch.arange(width * bs, device=self.device)
            if query_len == 1:
                mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            else:  # query j sees the keys up to its own position
                ends = lens.unsqueeze(1) - query_len + 1 + torch.arange(
                    query_len, device=self.device).unsqueeze(0)  # [B, S]
                mask = keys[None, None, :] < ends[:, :, None]  # [B, S, L]
                g = self.model_config.num_heads // self.model_config.num_kv_heads
                mask = mask[:, :, None, :].expand(-1, -1, g, -1).reshape(
                    len(context), 1, query_len * g, -1)
            groups.append(DecodeGroup(first + i * query_len, self._tensor(table), mask,
                                      query_len))
        return groups

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
