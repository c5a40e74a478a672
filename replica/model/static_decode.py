"""A decode context over fixed device buffers, so that one decode forward can be captured as a CUDA graph.

```
 fill(seqs, padded_to)   rows past len(seqs) repeat row 0 (same slot, position and pages)
   one host array ─► ONE copy, in place, into the static int64 buffer (addresses never change):
   [positions | k rows | v rows | seq rows (max_seqs, 3) | page table, page-major (max_pages, max_seqs)]
   ─► cos / signed sin gathered from the device RoPE table into static rows
 model(tokens[:b], ctx)  per layer: index_copy_ of the new k/v at the static rows, then the paged
                         kernel over the page table (fixed grid per b: no host sync, no .item())
```

The page table is stored page-major so that a step copies only the columns its longest sequence
uses (`used_pages * max_seqs` entries), not `max_seqs * max_pages`. Padded rows attend exactly as
row 0 does and write row 0's K/V bytes into row 0's slot again: harmless. A graph captured for b
rows reads the same buffers at every replay; `fill` only rewrites their contents.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from replica.errors import InvalidArgument
from replica.model.config import ModelConfig
from replica.model.kv_pages import HostStaging, PagedKVCache, SeqSlice, Span, spans
from replica.model.paged_attention import PagedBatch, paged_attention
from replica.model.rope import rotation_table, table_length


class StaticDecodeContext:
    """One-token decode rows for up to `max_seqs` sequences of at most `max_pages` pages each.

    `fill(seqs, padded_to)` before each forward; the forward then computes `padded_to` rows
    (`num_tokens == num_seqs == padded_to`), of which the first len(seqs) are the real ones.
    """

    def __init__(self, cache: PagedKVCache, config: ModelConfig, max_seqs: int, max_pages: int) -> None:
        if max_seqs <= 0 or max_pages <= 0:
            raise ValueError(f"max_seqs and max_pages must be positive, got {max_seqs}, {max_pages}")
        device = cache.tensor.device
        self.cache, self.config = cache, config
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.windows = tuple(config.window(layer) for layer in range(config.num_layers))
        n = max_seqs
        self._indices = torch.zeros(6 * n + max_pages * n, dtype=torch.int64, device=device)
        self._positions = self._indices[:n]
        self._k_rows = self._indices[n : 2 * n]
        self._v_rows = self._indices[2 * n : 3 * n]
        self._seqs = self._indices[3 * n : 6 * n].view(n, 3)  # (seqs, 3): first token, start, length
        self._pages = self._indices[6 * n :].view(max_pages, n).t()  # (seqs, max_pages), page-major
        self._arange = torch.arange(n, device=device)
        self._rope = rotation_table(config, cache.dtype, table_length(max_pages * cache.block_size), device)
        self._rotation = torch.zeros((n, 2, config.head_dim), dtype=cache.dtype, device=device)
        self._staging = HostStaging(device)
        self._bind(1)  # valid (zero) rows until the first fill

    def fill(self, seqs: Sequence[SeqSlice], padded_to: int) -> None:
        """Write the step's rows into the static buffers (one host→device copy), padded to `padded_to`."""
        found = self._validated(seqs, padded_to)
        rows = found + [found[0]] * (padded_to - len(found))
        self._staging.copy_into(self._pack(rows), self._indices)
        positions = self._positions[:padded_to]
        torch.index_select(self._rope, 0, positions, out=self._rotation[:padded_to])
        self._bind(padded_to)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store `layer`'s new k/v (b, kv_heads, head_dim), attend q (b, heads, head_dim) over the pages.

        Returns (b, heads * head_dim).
        """
        b, rows = self.num_tokens, self.cache.rows[layer]
        k, v = k.reshape(b, -1).to(rows.dtype), v.reshape(b, -1).to(rows.dtype)  # (b, kv_heads * head_dim)
        rows.index_copy_(0, self.k_rows, k)
        rows.index_copy_(0, self.v_rows, v)
        out = q.new_empty((b, q.shape[1] * q.shape[2]))
        paged_attention(q, self.cache.layer(layer), self._batch, out, self.windows[layer])
        return out

    def _validated(self, seqs: Sequence[SeqSlice], padded_to: int) -> list[Span]:
        found = spans(self.cache, seqs)
        if not len(found) <= padded_to <= self.max_seqs:
            held = self.max_seqs
            raise InvalidArgument(f"{len(found)} rows padded to {padded_to}: the context holds {held}")
        for s in found:
            if s.length != 1:
                raise InvalidArgument(f"sequence {s.seq}: a decode row feeds one token, got {s.length}")
            if len(s.pages) > self.max_pages:
                raise InvalidArgument(f"sequence {s.seq}: {len(s.pages)} pages, at most {self.max_pages}")
        return found

    def _pack(self, rows: list[Span]) -> array:
        """The buffer's prefix for `rows`: every section, and the page table's used columns."""
        bs, n = self.cache.block_size, self.max_seqs
        filler = [0] * (n - len(rows))
        positions = [s.start for s in rows]
        k_rows = [s.pages[s.start // bs] * 2 * bs + s.start % bs for s in rows]
        values = array("q", positions)
        values.extend(filler)
        values.extend(k_rows)
        values.extend(filler)
        values.extend(r + bs for r in k_rows)  # the V block follows the K block inside a page
        values.extend(filler)
        for i, s in enumerate(rows):
            values.extend((i, s.start, 1))
        values.extend(filler * 3)
        used = max(len(s.pages) for s in rows)
        padded = [s.pages + (0,) * (used - len(s.pages)) for s in rows]
        for column in zip(*padded, strict=True):  # page j of every row, then the rows' filler
            values.extend(column)
            values.extend(filler)
        return values

    def _bind(self, b: int) -> None:
        """Views of the first `b` rows: what the model reads (same addresses at every fill)."""
        self.num_tokens = self.num_seqs = b
        self.positions = self._positions[:b]  # (b,)
        self.last_token_index = self._arange[:b]  # (b,) one token per row
        self.k_rows, self.v_rows = self._k_rows[:b], self._v_rows[:b]
        self.cos = self._rotation[:b, :1]  # (b, 1, head_dim)
        self.sin_signed = self._rotation[:b, 1:]  # (b, 1, head_dim)
        self._batch = PagedBatch(self._seqs[:b], self._pages[:b], max_new=1)
