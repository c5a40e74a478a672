"""Paged attention in Triton: queries attend over KV pages read in place through a page table.

```
 grid: (sequence, kv_head, query tile)          cache layer: (blocks, 2, block_size, kv_heads, head_dim)
 a tile = BLOCK_M rows of (new token, query head of the kv head's group), padded with masked rows
   for each BLOCK_N keys from the window's first page to the tile's last query position:
     page ids ← page table[seq, key // block_size]; K, V ← layer[page, 0|1, key % block_size, kv_head]
     scores = q·Kᵀ (fp32) ─► causal + window mask ─► online softmax (running max, sum) ─► acc += p·V
   out[token, head] = acc / sum
```

All query heads of a grouped-query group share one program, so a decode step reads each K/V page
once per (sequence, KV head); keys outside the sliding window are never loaded. The same kernel runs
decode (one new token) and slices with several new tokens over a cached or migrated prefix (causal
within the new tokens). Queries and outputs stay in the flat ragged batch (read and written at each
sequence's first token), so no gather or scatter surrounds the launch.

Triton is imported on first use only (the kernel lives in `paged_kernel.py`, imported by
`_kernel`): a CPU run on the torch path never imports it, and `@triton.jit` reads TRITON_INTERPRET
when it decorates, so a test sets the variable first; the interpreter then runs the kernel on CPU
tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Any, NamedTuple

import torch

# The largest window (keys) the kernel is told when a layer has none: no position reaches it.
NO_WINDOW = 1 << 40


def triton_available() -> str | None:
    """None when the Triton kernel can run here, else why not (for the engine's choice at start).

    Looks for the package without importing it (a CPU run that never uses the kernel pays nothing).
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it ships with torch's CUDA builds and the dev extra)"
    return None


class PagedBatch(NamedTuple):
    """The sequences of one launch, on the device.

    `seqs[i] = (first, start, length)`: the flat index of sequence i's first new token in the batch,
    how many tokens are already in its pages, and how many are new (their K/V already written into
    the pages). `pages[i, j]` is the page holding positions `[j*block_size, (j+1)*block_size)`;
    entries past `ceil((start+length)/block_size)` are never read.
    """

    seqs: torch.Tensor  # (num_seqs, 3) int64
    pages: torch.Tensor  # (num_seqs, max_pages) int64, any strides
    max_new: int  # the longest new slice (sizes the grid: a host number, no device read)


def paged_attention(
    q: torch.Tensor,
    layer_pages: torch.Tensor,
    batch: PagedBatch,
    out: torch.Tensor,
    window: int | None,
    key_block: int = 64,
) -> None:
    """Attend the batch's queries over their pages and write their rows of `out`.

    q: (n, heads, head_dim) (any token/head strides, contiguous last dim); layer_pages: one layer of
    the cache, (blocks, 2, block_size, kv_heads, head_dim); out: (n, heads * head_dim), contiguous.
    Rows of tokens outside the batch are left as they are. Softmax scale 1/sqrt(head_dim), as SDPA.
    """
    _, _, block_size, kv_heads, head_dim = layer_pages.shape
    heads = q.shape[1]
    group = heads // kv_heads
    if q.stride(2) != 1 or layer_pages.stride(4) != 1 or not out.is_contiguous():
        raise ValueError("paged_attention needs a contiguous head_dim and a contiguous output")
    block_m = _query_block(group, batch.max_new)
    grid = (batch.seqs.shape[0], kv_heads, -(-batch.max_new * group // block_m))
    out3 = out.view(out.shape[0], heads, head_dim)  # (n, heads, head_dim)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _kernel(interpret)[grid](
        q, out3, layer_pages, batch.pages, batch.seqs,
        q.stride(0), q.stride(1), out3.stride(0), out3.stride(1),
        layer_pages.stride(0), layer_pages.stride(1), layer_pages.stride(2), layer_pages.stride(3),
        batch.pages.stride(0), batch.pages.stride(1), batch.seqs.stride(0),
        NO_WINDOW if window is None else window,
        math.log2(math.e) / math.sqrt(head_dim),
        head_dim,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=key_block,
        BLOCK_D=max(16, _next_power_of_two(head_dim)),
        # Triton's interpreter multiplies bfloat16 as its raw uint16 bits: give it float32 operands
        # (a product of two half values is exact in float32, so only summation order differs)
        UPCAST=interpret and layer_pages.dtype != torch.float32,
    )  # fmt: skip


def _next_power_of_two(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _query_block(group: int, max_new: int) -> int:
    """Query rows per program: a decode step's whole group (padded to 16, `tl.dot`'s minimum) so its
    pages are read once; longer slices take tiles of 64 rows."""
    if max_new == 1:
        return max(16, _next_power_of_two(group))
    return max(64, _next_power_of_two(group))


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    """The jitted kernel: its module is imported on first use, after TRITON_INTERPRET is set
    (`triton.jit` reads it when decorating), and re-imported if the variable changed since."""
    module = importlib.import_module("replica.model.paged_kernel")
    if interpret != module.INTERPRETED:
        module = importlib.reload(module)
    return module.paged_attention_kernel
