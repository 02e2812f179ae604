"""The Triton paged-attention kernel against a plain reference, run on CPU in Triton's
interpreter: mixed batches in one launch (decodes, verify rows, a prefill chunk after
earlier context, fresh prefills), block sizes that are not powers of two nor the key
tile, padded head dims, GQA groups up to MQA, shuffled block tables, three dtypes.
On a GPU (scripts/gpu_check.sh) the same tests run the compiled kernel on it."""
import os

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from pdserve.engine.triton_attention import paged_attention, write_kv

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py, without a GPU
DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.fixture(autouse=True, scope="module")
def bfloat16_dots_by_value():
    """The interpreter keeps bfloat16 as its uint16 bits and its `tl.dot` multiplies
    those bits (triton-lang/triton#11584; upstream: bfloat16 is not supported there).
    Widen the operands to float32 first: a GPU's bfloat16 MMA multiplies exactly and
    accumulates in float32 too, so the kernel is tested as it runs on one."""
    if not INTERPRETED:
        yield
        return
    dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, *args):
        return dot(self, widened(a), widened(b), *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        yield


# (q_len, seq_len) per sequence
MIXED = [(1, 1), (1, 17), (3, 12), (4, 33), (20, 50), (24, 24)]


def make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, gen):
    """Write every sequence's K/V into a NaN-filled cache through shuffled block ids,
    so a read of any slot past a sequence's end shows up in its output."""
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seqs), max(blocks_per_seq) + 1), num_blocks + 7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = ids[used:used + n].to(torch.int32)
        used += n
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"),
                          dtype=dtype)
    keys = [torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            for _, seq_len in seqs]
    values = [torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
              for _, seq_len in seqs]
    slots = torch.cat([table[b, torch.arange(seq_len) // block_size].long() * block_size
                       + torch.arange(seq_len) % block_size
                       for b, (_, seq_len) in enumerate(seqs)])
    write_kv(torch.cat(keys), torch.cat(values), kv_cache[0], kv_cache[1], slots)
    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32)
    # q as the engine gets it: a view of the fused projection's output, not contiguous
    qkv = torch.randn(int(q_lens.sum()), (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv.to(dtype)[:, :heads * head_dim].view(-1, heads, head_dim)
    return (q.to(DEVICE), kv_cache.to(DEVICE), keys, values, query_start_loc.to(DEVICE),
            seq_lens.to(DEVICE), table.to(DEVICE))


def reference(q, keys, values, query_start_loc, scale):
    """Each sequence's queries against its own K/V in float64, causal bottom-right."""
    out = torch.empty(q.shape, dtype=torch.float64)
    q = q.cpu()
    for b, (k, v) in enumerate(zip(keys, values)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[start:end].double().transpose(0, 1)  # [H, S, D]
        scores = qb @ k.transpose(1, 2) * scale
        q_len, seq_len = end - start, k.shape[1]
        visible = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + seq_len - q_len
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype, block_size, head_dim, heads, kv_heads, seqs", [
    (torch.float32, 16, 64, 8, 2, MIXED),  # GQA 4
    (torch.float32, 5, 80, 2, 2, MIXED),  # MHA, block size 5, padded head dim
    (torch.bfloat16, 1, 48, 8, 1, MIXED),  # MQA, one token per block
    (torch.float16, 32, 128, 4, 2, MIXED),  # GQA 2, blocks the size of the key tile
    (torch.float32, 16, 112, 6, 2, [(1, 40), (3, 70), (2, 2)]),  # G = 3: rows left over
    (torch.bfloat16, 5, 64, 4, 2, [(1, 9), (150, 150), (4, 130), (70, 100)]),  # query tiles
])
def test_matches_reference(dtype, block_size, head_dim, heads, kv_heads, seqs):
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim)
    q, kv_cache, keys, values, query_start_loc, seq_lens, table = make_batch(
        seqs, heads, kv_heads, head_dim, block_size, dtype, gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    max_query_len = max(q_len for q_len, _ in seqs)
    result = paged_attention(q, kv_cache[0], kv_cache[1], out, query_start_loc, seq_lens, table,
                             scale, max_query_len, block_size)
    assert result is out and out.dtype == dtype
    expected = reference(q, keys, values, query_start_loc, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


def test_decode_of_a_long_context_with_a_flat_softmax():
    # Scores that barely differ across 300 keys: the output is the mean of V, which
    # an error in the running rescale across key tiles would skew.
    gen = torch.Generator().manual_seed(3)
    q, kv_cache, keys, values, query_start_loc, seq_lens, table = make_batch(
        [(1, 300), (2, 301)], 4, 4, 64, 16, torch.float32, gen)
    out = paged_attention(q * 1e-3, kv_cache[0], kv_cache[1], torch.empty_like(q),
                          query_start_loc, seq_lens, table, 0.125, 2, 16)
    expected = reference(q * 1e-3, keys, values, query_start_loc, 0.125)
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0].double().cpu(), values[0].double().mean(0), atol=1e-3,
                               rtol=0)


def test_write_kv_stores_each_token_at_its_slot():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 6, 5, 2, 48
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                           device=DEVICE)
    k = torch.randn(7, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(7, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([29, 0, 4, 5, 13, 22, 17], device=DEVICE)
    write_kv(k, v, kv_cache[0], kv_cache[1], slots)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, block, offset], k[i])
        assert torch.equal(kv_cache[1, block, offset], v[i])
    assert int((kv_cache != 0).any(dim=(-1, -2)).sum()) == 2 * len(slots)
