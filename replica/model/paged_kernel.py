"""The Triton paged-attention kernel (see `paged_attention.py` for the wrapper and the picture).

Imported on first use only, so that triton is never imported on the torch path and `@triton.jit`
sees TRITON_INTERPRET as set at that moment. The kernel calls no jitted function of triton's
standard library (`tl.max`, `tl.sum` are decorated once, when triton.language is first imported,
possibly before the variable was set): its reductions use the combine functions below, decorated
here.
"""

import os

import triton
import triton.language as tl

# What `triton.jit` saw when this module was imported (`paged_attention._kernel` re-imports on change).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, table_ptr, seq_ptr,
    q_tok, q_head, out_tok, out_head,
    c_page, c_kv, c_slot, c_head,
    table_seq, table_page, seq_row,
    window, scale_log2, head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    first = tl.load(seq_ptr + seq * seq_row)
    start = tl.load(seq_ptr + seq * seq_row + 1)
    length = tl.load(seq_ptr + seq * seq_row + 2)

    rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) row = token * GROUP + head in group
    row_ok = rows < length * GROUP
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = start + tok  # absolute position of each row's query
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_rows = (first + tok).to(tl.int64) * q_tok + head * q_head
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    q = q.to(cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # keys [lo, hi): from the oldest position the tile's first query sees to its last query's own
    last_tok = tl.minimum(length - 1, (m0 + BLOCK_M - 1) // GROUP)
    hi = tl.where(m0 < length * GROUP, start + last_tok + 1, 0)
    lo = tl.maximum(start + m0 // GROUP - window + 1, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) absolute key positions
        key_ok = (keys >= lo) & (keys < hi)  # masked loads: pages outside are never read
        in_table = seq * table_seq + (keys // BLOCK_SIZE) * table_page
        page = tl.load(table_ptr + in_table, mask=key_ok, other=0)
        at = page.to(tl.int64) * c_page + (keys % BLOCK_SIZE) * c_slot + kv_head * c_head
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + c_kv + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        seen = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(seen & key_ok[None, :], scores, float("-inf"))  # (BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, maximum))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, add)
        p = p.to(cache_ptr.dtype.element_ty)  # P·V in the cache's dtype, as flash attention does
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = (first + tok).to(tl.int64) * out_tok + head * out_head
    out_mask = row_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
