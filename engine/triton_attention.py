"""Paged attention for a flat mixed batch in one Triton launch.

Every sequence in the batch follows one rule: its `q_len` query tokens are the last
`q_len` of its `seq_len` positions, and query i attends keys 0 .. seq_len - q_len + i
(causal, aligned bottom-right). That covers decodes (q_len 1), verify rows (a decode
with its draft tokens), prefill chunks after earlier context and fresh prefills, so
the batch needs no split by kind.

One program computes one tile of a sequence's queries for one KV head. The rows of
its Q tile are (query token, query head of that KV head) pairs, so each K/V tile is
loaded once for all G = H // Hkv heads that share it (GQA; MQA is Hkv = 1). Keys are
walked in tiles of a fixed power-of-two number of tokens, each token's cache block
looked up through the block table, so K and V are read in place and the engine's
block size need not be a power of two nor match the tile. The softmax is online
(flash-attention): running max and sum per row, accumulated in fp32.

`write_kv` stores the step's new K/V first, as `TorchAttention` does; the kernel then
reads them back from the cache with the rest of the context.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.attention import AttentionBackend, StepMetadata

KEY_TILE = 32  # key tokens per inner-loop step
MIN_ROWS = 16  # tl.dot wants at least 16 rows; a decode tile is mostly padding
MAX_ROWS = 64  # rows of a prefill's Q tile: (tokens per tile) * G


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    block_size,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two
    QUERIES_PER_TILE: tl.constexpr,  # query tokens per program
    ROWS: tl.constexpr,  # power of two >= QUERIES_PER_TILE * GROUP
    KEY_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_query = q_tile * QUERIES_PER_TILE
    if first_query >= q_len:
        return  # the grid is sized for the longest query; this sequence is shorter
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # positions before the first query token

    rows = tl.arange(0, ROWS)
    query = first_query + rows // GROUP  # within the sequence's queries
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < QUERIES_PER_TILE * GROUP) & (query < q_len)
    query_pos = context_len + query  # the last key each row may see
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = (q_start + query).to(tl.int64)
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)

    row_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys past the tile's last query position are masked for every row: stop there.
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, q_len) - 1
    num_keys = context_len + last_query + 1
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    keys = tl.arange(0, KEY_TILE)
    for tile_start in range(0, num_keys, KEY_TILE):
        pos = tile_start + keys
        key_valid = pos < num_keys
        block = tl.load(table_row + pos // block_size, mask=key_valid, other=0).to(tl.int64)
        slot = pos % block_size
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        # K as [HEAD_DIM_PAD, KEY_TILE], V as [KEY_TILE, HEAD_DIM_PAD]
        k = tl.load(k_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks
                    + kv_head * stride_kh + dims[:, None] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :] * stride_vd,
                    mask=tl.trans(kv_mask), other=0.0)

        scores = tl.dot(q, k, input_precision="ieee") * qk_scale
        # Key 0 is visible to every row, padding rows included, so a row's max is
        # finite from the first tile on and exp2 never sees -inf - -inf.
        visible = key_valid[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_max = new_max

    out = acc / row_sum[:, None]
    out_offsets = (token[:, None] * stride_ot + head[:, None] * stride_oh
                   + dims[None, :] * stride_od)
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float, max_query_len: int,
                    block_size: int) -> torch.Tensor:
    """Attend every query token of the batch to its sequence's cached keys; writes `out`.

    q, out: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D], any strides;
    query_start_loc: int32 [B + 1]; seq_lens: int32 [B], including the query tokens,
    whose K/V are already in the cache; block_table: int32 [B, max_blocks].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert k_cache.shape == v_cache.shape and k_cache.shape[1] == block_size
    assert k_cache.shape[3] == head_dim and num_heads % num_kv_heads == 0
    assert query_start_loc.shape[0] == num_seqs + 1 and block_table.shape[0] == num_seqs
    assert block_table.stride(1) == 1
    assert triton.next_power_of_2(head_dim) >= 16, "tl.dot needs 16 columns or more"
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    rows = min(MAX_ROWS, triton.next_power_of_2(max_query_len * group))
    rows = max(rows, MIN_ROWS, triton.next_power_of_2(group))
    queries_per_tile = rows // group
    grid = (num_seqs, triton.cdiv(max_query_len, queries_per_tile), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_table,
        scale * 1.4426950408889634, block_size,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUERIES_PER_TILE=queries_per_tile, ROWS=rows, KEY_TILE=KEY_TILE,
    )
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new K/V ([T, Hkv, D]) at their flat slots (block * block_size +
    offset; slot_mapping: long [T]), one indexed copy each."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TritonAttention(AttentionBackend):
    """The paged kernel as the engine's backend: the step's metadata is the kernel's
    own (nothing to build), K/V written by one indexed copy each, then one launch per
    layer for the whole mixed batch."""
    name = "triton"

    def build(self, step: StepMetadata) -> StepMetadata:
        return step

    def forward(self, q, k, v, kv_cache, meta: StepMetadata):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                        meta.block_table, self.scale, meta.max_query_len, self.block_size)
        return out.view(q.shape[0], self.num_heads * self.head_dim)
