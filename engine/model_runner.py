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
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

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
        batch, samplers = self._order(out)
        logits = self.forward_logits(batch, samplers, on_layer_done)
        result = ModelRunnerOutput()
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
                       on_layer_done: LayerHook | None = None) -> torch.Tensor:
        """Computes `batch` (decodes first); logits [len(samplers), vocab] float32."""
        input_ids, positions, meta, logits_indices = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.rope, self.backend, self.kv_caches,
                            meta, on_layer_done)
        return self.model.compute_logits(hidden[logits_indices])

    def _order(self, out: SchedulerOutput):
        decodes, prefills = [], []
        for request, n in zip(out.requests, out.num_scheduled):
            (decodes if n == 1 else prefills).append((request, n))
        decodes.sort(key=lambda item: item[0].num_computed_tokens)
        batch = decodes + prefills
        samplers = [r for r, n in batch if r.num_computed_tokens + n == r.num_tokens]
        return batch, samplers

    def _prepare(self, batch: list[tuple[Request, int]]):
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
        prefills = []
        for request, n in batch[num_decodes:]:
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
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), num_decode_tokens=num_decodes,
            decode_groups=self._decode_groups(batch[:num_decodes]), prefills=prefills)
        return (self._tensor(input_ids), self._tensor(positions), meta,
                self._tensor(logits_indices))

    def _decode_groups(self, decodes: list[tuple[Request, int]]) -> list[DecodeGroup]:
        bs = self.block_size
        groups = []
        for start in range(0, len(decodes), DECODE_GROUP_SIZE):
            members = [r for r, _ in decodes[start:start + DECODE_GROUP_SIZE]]
            context = [r.num_computed_tokens + 1 for r in members]
            width = -(-max(context) // bs)
            table = [r.block_ids[:width] + [0] * (width - len(r.block_ids[:width]))
                     for r in members]
            lens = self._tensor(context)
            mask = torch.arange(width * bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
            groups.append(DecodeGroup(start, self._tensor(table), mask[:, None, None, :]))
        return groups

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
