"""Runs one scheduled step on the device: flat inputs, model forward, sampling.

A sampling batch that raises is sampled again row by row, so the requests whose own
rows fail are the only ones to fail (ModelRunnerOutput.failed). An error no single
row reproduces, or one in the forward pass, belongs to the step: it propagates.

Under tensor parallelism every rank has a runner over its shard; rank 0's (the
engine's) describes each step once (StepInputs) and broadcasts it before computing it
itself, and only rank 0 samples (engine/parallel/)."""
from __future__ import annotations

import logging

import torch

from pdserve.engine.attention import make_backend, resolve
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pdserve.engine.kv_cache import allocate_kv_cache, copy_blocks
from pdserve.engine.model.llama import LayerHook
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.host_kv_cache import HostKVCache
from pdserve.engine.parallel.messages import CopyKV, Forward, InitKVCache, RankExport, Shutdown
from pdserve.engine.parallel.sharding import Shard
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler_output import KVCopies, ModelRunnerOutput, SchedulerOutput, Verified
from pdserve.engine.step_buffers import StepBuffers, StepInputs
from pdserve.engine.structured_outputs import Grammars, GrammarViolation

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# forward_tokens: chunks up to this long are the step's few-token sequences (a draft
# model catching up on a verification's tokens); longer ones (a prompt) prompt chunks.
GROUPED_CHUNK = 16
log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 group: TensorParallelGroup | None = None, grammars: Grammars | None = None):
        """group: this rank's tensor-parallel group (None: the whole model, here).
        grammars: the structured-output state of the rank that samples."""
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.resolved_dtype]
        self.group = group
        shard = Shard.of(model_config, group.size, group.rank) if group else Shard.of(model_config)
        self.model_config = shard.local_config(model_config)  # this rank's heads
        self.model = load_model(config.model, model_config, self.device, self.dtype,
                                shard, group)
        self.rope = RotaryEmbedding(model_config, max_model_len, self.device, self.dtype)
        self.block_size = config.cache.block_size
        self.backend = make_backend(resolve(config.attention_backend, self.device),
                                    shard.num_heads, shard.num_kv_heads,
                                    model_config.head_dim, self.block_size)
        # Decode steps from CUDA graphs (cuda_graphs.py) where they can be captured:
        # not yet across a tensor-parallel group (every rank would capture and replay
        # its collectives in step).
        sched = config.scheduler
        self.graphs = DecodeGraphs(capture_sizes(sched.max_num_seqs), capture=True) \
            if (self.device.type == "cuda" and self.backend.name == "triton"
                and not config.enforce_eager and group is None) else None
        largest = self.graphs.max_size if self.graphs else 1
        # Sized for every step the scheduler makes, so they never move (captured graphs
        # read them): a table row holds a whole max_model_len context.
        self.buffers = StepBuffers(self.device, self.block_size,
                                   max_tokens=max(sched.max_num_batched_tokens, largest),
                                   max_seqs=max(sched.max_num_seqs, largest),
                                   max_blocks=-(-max_model_len // self.block_size))
        self._captured = 0  # the buffers' generation the graphs were captured over
        self._broken = False  # a step failed on this rank after its broadcast
        self.scratch_block = 0  # set with the cache: a block no request owns
        self.kv_caches: list[torch.Tensor] = []
        self.host_cache: HostKVCache | None = None  # host memory's blocks, if any
        self.sampler = Sampler(config.seed, grammars)

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """After the weights are in place, so a device budget counts what is left. One
        block more than the block manager hands out: the scratch block, where padding
        rows of a padded decode step write and read (cuda_graphs.py). Then the decode
        graphs are captured. num_host_blocks: host memory's (engine/host_kv_cache.py).
        Rank 0 of a group tells the others first."""
        if self._leads:
            self.group.broadcast(InitKVCache(num_blocks=num_blocks,
                                             num_host_blocks=num_host_blocks))
        self.kv_caches = allocate_kv_cache(self.model_config, num_blocks + 1, self.block_size,
                                           self.device, self.dtype)
        self.scratch_block = num_blocks
        if num_host_blocks:
            self.host_cache = HostKVCache(self.model_config, num_host_blocks, self.block_size,
                                          self.device, self.dtype)
        if self.graphs is not None:
            self._capture()

    @torch.inference_mode()
    def copy_kv(self, copies: KVCopies, wait: bool = False) -> None:
        """Copies between device and host blocks (and within the device), on every rank (rank 0 tells the
        others first: they run them before the Forward that follows). wait: return
        once this rank's copies are done (on cuda they are otherwise only queued
        before the step's forward pass)."""
        if self._leads:
            self.group.broadcast(CopyKV(copies=copies))
        if copies.to_host or copies.to_device:
            self.host_cache.copy(self.kv_caches, copies)
        if copies.within:  # after the swap-outs (one may read a block it fills)
            copy_blocks(self.kv_caches, copies.within)
        if wait and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def _leads(self) -> bool:
        """Rank 0 of a tensor-parallel group: it describes the steps the others run."""
        return self.group is not None and self.group.rank == 0

    def close(self) -> None:
        """Rank 0: the other ranks end; this rank's group closes (idempotent). After a
        failed step the group is closed without a word: its ranks' collectives fail."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            if group.rank == 0 and not self._broken:
                group.broadcast(Shutdown())
        finally:
            group.close()

    def _capture(self) -> None:
        """Each capture size's forward over an all-padding step, captured."""
        def padding_only(size: int) -> tuple:
            ids, pos, meta, _ = self.buffers.fill_from(self._prepare([], {}, pad_to=size))
            return ids, pos, self.backend.build(meta)

        def forward(filled: tuple) -> torch.Tensor:
            ids, pos, meta = filled
            return self.model(ids, pos, self.rope, self.backend, self.kv_caches, meta)
        with torch.inference_mode():
            self.graphs.capture_all(padding_only, forward, self.device)
        self._captured = self.buffers.generation

    def _graph_size(self, batch: list[tuple[Request, int]], on_layer_done) -> int | None:
        """The padded size a step runs at through the decode graphs, or None (eager):
        decode-only steps (one token each) with no KV export hook, up to the largest
        capture size."""
        if self.graphs is None or on_layer_done is not None or not batch \
                or any(n != 1 for _, n in batch):
            return None
        size = self.graphs.size_for(len(batch))
        if size is not None and self.graphs.capture and self._captured != self.buffers.generation:
            self._capture()  # a larger step moved the buffers since
        return size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_layer_done: LayerHook | None = None,
                rank_exports: tuple[RankExport, ...] = ()) -> ModelRunnerOutput:
        """rank_exports: the KV the other ranks of a tensor-parallel group send as
        they compute this step (told them with it). The step's copies between device
        and host blocks run first."""
        if out.kv_copies:
            # (a step of copies alone has no sampling to wait on before its blocks
            # are released: it waits for them itself)
            self.copy_kv(out.kv_copies, wait=not out.requests)
            if not out.requests:
                return ModelRunnerOutput()
        batch, samplers, verifiers = self._order(out)
        logits = self.forward_logits(batch, samplers, on_layer_done, out.spec_token_ids,
                                     rank_exports)
        result = ModelRunnerOutput()
        verified = len(samplers) + sum(len(out.spec_token_ids[r.request_id]) + 1
                                       for r in verifiers)
        if verified < logits.shape[0]:
            self._prompt_logprobs(logits[verified:], batch, verifiers)
        if verifiers:
            self._verify(logits[len(samplers):verified], verifiers, out.spec_token_ids, result)
        logits = logits[:len(samplers)]
        if not samplers:
            return result
        params = None
        if not out.steady and any(r.num_choices > 1 and not r.output_token_ids
                                  for r in samplers):
            logits, samplers, params = _with_choices(logits, samplers)
        try:
            rows = list(zip(range(len(samplers)), samplers,
                            *self.sampler.sample(logits, samplers, params)))
        except Exception as batch_error:
            rows = self._sample_each(logits, samplers, batch_error, result.failed, params)
        for i, request, token, logprob, top in rows:
            rid = request.request_id
            if rid in result.failed:
                continue  # (one of its choices' rows failed: the request did)
            if params is not None and params[i] is not request.sampling_params:
                result.choices.setdefault(rid, []).append((token, logprob, top))
                continue
            result.sampled_token_ids[rid] = token
            if logprob is not None:
                result.logprobs[rid] = logprob
            if top is not None:
                result.top_logprobs[rid] = top
        return result

    def _prompt_logprobs(self, logits: torch.Tensor, batch: list[tuple[Request, int]],
                         verifiers: list[Request]) -> None:
        """logits: the rows after the sampled and verified ones, one per prompt position
        whose next token's logprob a request asks for (the order _prepare gave them):
        each logprob, rank and top logprobs kept on the request (Request.prompt_logprobs; a
        recomputed prompt writes the same values again)."""
        rows = torch.log_softmax(logits, dim=-1)
        targets, wanted = [], []  # per row: the prompt token, and (request, its position)
        for request, n in batch:
            if request in verifiers:
                continue
            start = request.num_computed_tokens
            for pos in request.prompt_logprob_positions(start, n):
                targets.append(request.prompt_token_ids[pos + 1])
                wanted.append((request, pos + 1))
        chosen = rows.gather(1, torch.tensor(targets, device=rows.device).unsqueeze(1))
        ranks = ((rows > chosen).sum(dim=1) + 1).tolist()
        k = max(r.sampling_params.prompt_logprobs for r, _ in wanted)
        top = rows.topk(k) if k else None
        values = chosen.squeeze(1).tolist()
        indices = top.indices.tolist() if k else None
        top_values = top.values.tolist() if k else None
        for j, ((request, pos), value) in enumerate(zip(wanted, values)):
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None] * request.num_prompt_tokens
            n = request.sampling_params.prompt_logprobs
            request.prompt_logprobs[pos] = (value, ranks[j], dict(
                zip(indices[j][:n], top_values[j][:n])) if n else {})

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
                     batch_error: Exception, failed: dict[str, str],
                     params: list | None = None) -> list[tuple]:
        """The batch failed to sample: each row alone, recording the rows that fail
        (the rows that sampled, with their places in the batch). None failing alone,
        or all of several, means the error is not one request's: re-raised."""
        rows = []
        own = 0  # failures that are the request's by their kind (its grammar left)
        for i, request in enumerate(samplers):
            try:
                rows.append((i, request, *(column[0] for column in self.sampler.sample(
                    logits[i:i + 1], [request], params and params[i:i + 1]))))
            except Exception as exc:
                log.exception("sampling failed for request %s alone", request.request_id)
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                failed[request.request_id] = f"sampling failed: {type(exc).__name__}: {first}"
                own += isinstance(exc, GrammarViolation)
        distinct = len({r.request_id for r in samplers})  # (a request's choices' rows too)
        if not failed or (len(failed) == distinct > 1 and own < len(failed)):
            failed.clear()  # no row, or every row: not one request's doing
            raise batch_error
        return rows

    @torch.inference_mode()
    def forward_logits(self, batch: list[tuple[Request, int]], samplers: list[Request],
                       on_layer_done: LayerHook | None = None,
                       drafts: dict[str, list[int]] | None = None,
                       rank_exports: tuple[RankExport, ...] = ()) -> torch.Tensor:
        """Computes `batch` (decodes first); logits [len(samplers), vocab] float32, then
        every position of each request verifying `drafts` (rid -> its drafts)."""
        size = self._graph_size(batch, on_layer_done)
        step = self._prepare(batch, drafts or {}, size)
        if not self._leads:
            return self.run_step(step, size, on_layer_done)
        try:  # (the broadcast too: the first collective to meet a lost rank may be it)
            self.group.broadcast(Forward(step=step.trimmed(self.block_size),
                                         exports=rank_exports))
            return self.run_step(step, size, on_layer_done)
        except BaseException as exc:
            # The other ranks may wait in a collective this rank will not reach: the
            # group is closed (their collectives fail), never told to stop.
            self._broken = True
            size = self.group.size
            self.close()
            exc.add_note(f"tensor_parallel_size {size}: a step failed on rank 0, or another "
                         "rank failed or was lost; this engine's ranks are closed")
            raise

    @torch.inference_mode()
    def run_step(self, step: StepInputs, size: int | None = None,
                 on_layer_done: LayerHook | None = None) -> torch.Tensor | None:
        """The forward pass over `step` and its wanted rows' logits (None on a rank
        other than 0 of a group). size: the graph size it runs at, or None (eager)."""
        input_ids, positions, metadata, logits_indices = self.buffers.fill_from(step)
        meta = self.backend.build(metadata)
        if size is None:
            hidden = self.model(input_ids, positions, self.rope, self.backend, self.kv_caches,
                                meta, on_layer_done)
        else:  # replayed over the buffers just filled, or run eagerly where not captured
            assert not self.graphs.capture or self._captured == self.buffers.generation, \
                "the step moved the buffers the graphs read"
            hidden = self.graphs.run(size, lambda: self.model(
                input_ids, positions, self.rope, self.backend, self.kv_caches, meta))
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

    def _prepare(self, batch: list[tuple[Request, int]], drafts: dict[str, list[int]],
                 pad_to: int | None = None) -> StepInputs:
        """The step's inputs: token ids, positions, the slots and block tables the
        attention backend's metadata is built from, the rows to sample (then the
        verified ones). pad_to: a decode-only step padded to that many rows, each
        decoding token 0 at position 0 in the scratch block."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []  # rows giving prompt logprobs (Request's order)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        num_decodes = 0
        for request, n in batch:
            if n != 1:
                break
            pos = request.num_computed_tokens
            blocks = request.block_ids
            input_ids.append(request.token_at(pos))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            if pos + 1 == request.num_tokens:
                logits_indices.append(num_decodes)
            if request.scores_prompt and pos in request.prompt_logprob_positions(pos, 1):
                prompt_indices.append(num_decodes)
            num_decodes += 1
            seq_lens.append(pos + 1)
            tables.append(blocks)
        query_lens += [1] * num_decodes
        verifying = [(r, n) for r, n in batch[num_decodes:] if r.request_id in drafts]
        for request, n in verifying:  # its last known token, then the drafts
            start = request.num_computed_tokens
            input_ids.append(request.token_at(start))
            input_ids.extend(drafts[request.request_id])
            positions.extend(range(start, start + n))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(blocks)
        verify_indices = list(range(num_decodes, len(input_ids)))  # logits at every position
        if pad_to:
            pad, scratch = pad_to - len(query_lens), self.scratch_block
            input_ids += [0] * pad
            positions += [0] * pad
            slots += [scratch * bs] * pad
            query_lens += [1] * pad
            seq_lens += [1] * pad
            tables += [[scratch]] * pad
        num_decode_tokens = len(input_ids)
        num_grouped = len(query_lens)
        for request, n in batch[num_decodes + len(verifying):]:
            start = request.num_computed_tokens
            blocks = request.block_ids
            input_ids.extend(request.token_ids(start, start + n))
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
            if start + n == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
            if request.scores_prompt:
                first = len(input_ids) - n - start
                prompt_indices.extend(first + p
                                      for p in request.prompt_logprob_positions(start, n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(blocks)
        return StepInputs(input_ids=input_ids, positions=positions, slots=slots,
                          logits_indices=logits_indices + verify_indices + prompt_indices,
                          query_lens=query_lens, seq_lens=seq_lens, block_ids=tables,
                          num_decodes=num_grouped, num_decode_tokens=num_decode_tokens)

    @torch.inference_mode()
    def forward_tokens(self, chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """A forward pass over tokens given directly (a draft model's): each chunk is
        (tokens, first position, block ids), after the KV already in its blocks.
        Logits [len(chunks), vocab], after each chunk's last token. Chunks of up to
        GROUPED_CHUNK tokens go first, by length, as the few-token sequences of the
        step (attended in groups of equal length by the torch backend), longer ones
        as prompt chunks."""
        bs = self.block_size
        order = sorted(range(len(chunks)), key=lambda i: (len(chunks[i][0]) > GROUPED_CHUNK,
                                                          len(chunks[i][0])))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        last = [0] * len(chunks)  # chunk -> the flat index of its last token
        num_grouped = num_grouped_tokens = 0
        for i in order:
            tokens, start, blocks = chunks[i]
            n = len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            last[i] = len(input_ids) - 1
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(blocks)
            if n <= GROUPED_CHUNK:
                num_grouped += 1
                num_grouped_tokens += n
        assert self.group is None, "a draft model runs whole, on rank 0"
        return self.run_step(StepInputs(
            input_ids=input_ids, positions=positions, slots=slots, logits_indices=last,
            query_lens=query_lens, seq_lens=seq_lens, block_ids=tables,
            num_decodes=num_grouped, num_decode_tokens=num_grouped_tokens))


def _with_choices(logits: torch.Tensor, samplers: list[Request]
                  ) -> tuple[torch.Tensor, list[Request], list]:
    """Parallel sampling: a request for n > 1 sequences at its first token draws the
    first tokens of choices 1 .. n-1 too, from copies of its logits row (each under
    its choice's parameters: SamplingParams.for_choice), as rows after the batch's."""
    rows = [i for i, r in enumerate(samplers) if r.num_choices > 1 and not r.output_token_ids
            for _ in range(1, r.num_choices)]
    extra = [samplers[i] for i in rows]
    params = [r.sampling_params for r in samplers]
    index: dict[str, int] = {}
    for r in extra:
        index[r.request_id] = index.get(r.request_id, 0) + 1
        params.append(r.sampling_params.for_choice(index[r.request_id]))
    rows_t = torch.tensor(rows, device=logits.device)
    return torch.cat([logits, logits.index_select(0, rows_t)]), samplers + extra, params
