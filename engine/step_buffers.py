"""A step's inputs in persistent buffers: token ids, positions, the indices of the rows
to sample, and the attention seam's StepMetadata (query start offsets, sequence
lengths, an int32 block table, the slot mapping).

Each step the runner's host lists are written into host staging (pinned on CUDA) and
copied into device buffers of a fixed address, sliced to the step's size: no tensor is
allocated per step (what captured CUDA graphs need: they replay over the same
addresses). On CPU the staging is the buffer. A step larger than the buffers grows
them (to the next power of two), once."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.engine.attention import StepMetadata


@dataclass(frozen=True)
class StepInputs:
    """One step's host lists, as `StepBuffers.fill` takes them (the runner builds
    them; under tensor parallelism rank 0 broadcasts them to the other ranks)."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_indices: list[int]  # the flat rows whose logits are wanted
    query_lens: list[int]
    seq_lens: list[int]
    block_ids: list[list[int]]  # sequence b's blocks, at least its seq_lens[b] tokens'
    num_decodes: int  # the leading sequences attended in groups (decode-shaped)
    num_decode_tokens: int

    def trimmed(self, block_size: int) -> "StepInputs":
        """The same step with each table cut to its sequence's blocks (what another
        rank needs: a request's whole block list may be longer), for the wire only;
        the runner's own step keeps the lists it was given, uncopied."""
        return replace(self, block_ids=[blocks[:-(-n // block_size)] for blocks, n
                                        in zip(self.block_ids, self.seq_lens)])


class _Buffer:
    """One input: host staging and its device twin, `size` entries of each row."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rows: int, width: int = 0):
        self.device, self.dtype, self.width = device, dtype, width
        shape = (rows, width) if width else (rows,)
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.host.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host

    @property
    def rows(self) -> int:
        return self.host.shape[0]

    def upload(self, rows: int, width: int = 0) -> torch.Tensor:
        """The device view of the first `rows` (and `width` columns), after copying
        them from staging."""
        if self.dev is not self.host and rows:  # whole rows: one contiguous pinned copy
            self.dev[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.dev[:rows, :width] if self.width else self.dev[:rows]


def _grown(n: int, have: int) -> int:
    return have if n <= have else 1 << max(n - 1, 1).bit_length()


class StepBuffers:
    def __init__(self, device: torch.device, block_size: int, max_tokens: int = 2048,
                 max_seqs: int = 256, max_blocks: int = 128):
        self.device, self.block_size = device, block_size
        self.generation = 0  # counts allocations: captured graphs read one generation's
        # On CUDA, the last step's uploads: staging is written again only once they
        # ran (a step that samples nothing, a prompt chunk, never waits on the device,
        # and its copies may still be queued when the next step fills).
        self._uploaded: torch.cuda.Event | None = None
        self._alloc(max_tokens, max_seqs, max_blocks)

    def _alloc(self, tokens: int, seqs: int, blocks: int) -> None:
        self.generation += 1
        d = self.device
        self.input_ids = _Buffer(d, torch.long, tokens)
        self.positions = _Buffer(d, torch.long, tokens)
        self.slot_mapping = _Buffer(d, torch.long, tokens)
        self.logits_indices = _Buffer(d, torch.long, tokens)
        self.query_start_loc = _Buffer(d, torch.int32, seqs + 1)
        self.seq_lens = _Buffer(d, torch.int32, seqs)
        self.block_table = _Buffer(d, torch.int32, seqs, blocks)

    def _fit(self, tokens: int, seqs: int, blocks: int) -> None:
        have = (self.input_ids.rows, self.seq_lens.rows, self.block_table.width)
        want = (_grown(tokens, have[0]), _grown(seqs, have[1]), _grown(blocks, have[2]))
        if want != have:
            self._alloc(*want)

    def fill_from(self, step: StepInputs
                  ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
        return self.fill(step.input_ids, step.positions, step.slots, step.logits_indices,
                         step.query_lens, step.seq_lens, step.block_ids, step.num_decodes,
                         step.num_decode_tokens)

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int],
             logits_indices: list[int], query_lens: list[int], seq_lens: list[int],
             block_ids: list[list[int]], num_decodes: int, num_decode_tokens: int,
             ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
        """The step's device tensors: input ids, positions, the StepMetadata, the
        flat indices of the rows whose logits are wanted. block_ids[b]: sequence b's
        blocks, at least enough for seq_lens[b] tokens."""
        t, b, bs = len(input_ids), len(query_lens), self.block_size
        width = -(-max(seq_lens) // bs) if b else 0
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._fit(max(t, len(logits_indices)), b, width)
        self.input_ids.np[:t] = input_ids
        self.positions.np[:t] = positions
        self.slot_mapping.np[:t] = slots
        self.logits_indices.np[:len(logits_indices)] = logits_indices
        starts = self.query_start_loc.np
        starts[0] = 0
        np.cumsum(query_lens, out=starts[1:b + 1])
        self.seq_lens.np[:b] = seq_lens
        table = self.block_table.np
        table[:b, :width] = 0
        for row, (blocks, n) in enumerate(zip(block_ids, seq_lens)):
            k = -(-n // bs)
            table[row, :k] = blocks[:k]
        meta = StepMetadata(
            query_start_loc=self.query_start_loc.upload(b + 1),
            seq_lens=self.seq_lens.upload(b),
            block_table=self.block_table.upload(b, width),
            slot_mapping=self.slot_mapping.upload(t),
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            query_lens=query_lens, seq_lens_host=seq_lens, block_ids=block_ids)
        uploaded = (self.input_ids.upload(t), self.positions.upload(t), meta,
                    self.logits_indices.upload(len(logits_indices)))
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return uploaded
