"""The one context object attention reads the paged KV cache through, per forward.

```
 flat ragged batch (n tokens)        PagedKVCache.tensor  (layers, blocks, 2, block_size, kv_heads, head_dim)
 seq0: start=0 length=5 (prefill)      layer l, page p = tensor[l, p] = K block | V block (contiguous)
 seq1: start=7 length=1 (decode)  ──►  new k/v are scattered into their slots, then per group:
 seq2: start=3 length=4 (resumed)      torch:  pages gathered into a padded (seqs, ctx, kv_heads, head_dim),
                                               one masked scaled_dot_product_attention call
                                       triton: decode + resumed read in place through the page table
                                               (paged_attention.py); fresh prompts keep SDPA
```

`AttentionContext.build` precomputes, once per forward, every index and mask the layers reuse:
the cache row of each new token's K and V, and per *group* of sequences (all one-token decodes in
one group, longer slices in another, so a long prefill does not pad every decode to its length) the
flat page table, query placement and the causal (and sliding-window) masks; plus the RoPE cos/sin
rows. Every index list of a forward goes to the device in one copy (`IndexPack` → `cache.upload`).
Pages of a sequence are listed in order; page `i` holds positions `[i*block_size,
(i+1)*block_size)`, and may be any block of the cache. Under a sliding window a decode group
gathers only the pages the window reaches: a step reads O(window) keys per sequence however long
the context (about the keys transformers' sliding cache keeps, which matters for bf16 rounding).

Queries are grouped per KV head — (seqs, kv_heads, group * new, head_dim) — so grouped-query
attention needs no repeated keys or values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from replica.errors import InvalidArgument
from replica.model import native_attention
from replica.model.compiled_attention import decode_attention
from replica.model.config import ModelConfig
from replica.model.kv_pages import IndexPack, PagedKVCache, SeqSlice, Span, as_int64, spans
from replica.model.paged_attention import PagedBatch, paged_attention, triton_available
from replica.model.rope import rotation_rows
from replica.model.static_decode import StaticDecodeContext

__all__ = [
    "AttentionContext",
    "Backend",
    "ForwardContext",
    "PagedKVCache",
    "SeqSlice",
    "StaticDecodeContext",
    "as_int64",
    "triton_available",
]


class Backend(StrEnum):
    """How attention reads the pages: the torch reference (the CPU path) or the Triton kernel."""

    TORCH = "torch"
    TRITON = "triton"
    COMPILED = "compiled"  # torch, but decode groups through the inductor kernel (compiled_attention.py)
    NATIVE = "native"  # torch, but decode groups through the C++ kernel (native_attention.py)


_BACKENDS = {b.value: b for b in Backend}  # a dict lookup: cheaper per forward than Backend(name)


class ForwardContext(Protocol):
    """What the model reads of a context: `AttentionContext` (any batch) or `StaticDecodeContext`."""

    cos: torch.Tensor  # (n, 1, head_dim)
    sin_signed: torch.Tensor  # (n, 1, head_dim)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@functools.lru_cache(maxsize=64)
def _arange(length: int, device: torch.device) -> torch.Tensor:
    """Memoised key positions 0..length-1 (read only: masks are computed from it, never into it)."""
    return torch.arange(length, device=device)


@functools.lru_cache(maxsize=16)
def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim -inf and 0 of `dtype`: `torch.where` over them builds an additive mask in one op."""
    minus_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    return minus_inf, torch.zeros((), dtype=dtype, device=device)


class _WindowPages(NamedTuple):
    """A one-token group's gather under a sliding window: only the pages the window reaches."""

    table: torch.Tensor  # (seqs * pages,) page ids, each row padded with its last page
    ctx: int  # keys per row: pages * block_size
    first_pos: torch.Tensor  # (seqs,) absolute position of each row's first gathered key


class _PackedWindow(NamedTuple):
    """`_WindowPages` before the upload: its lists' piece numbers in the forward's `IndexPack`."""

    table: int
    ctx: int
    first_pos: int


class _Group:
    """Sequences attended together (torch path): padded to the longest new slice and context.

    Built in two steps: `__init__` adds the group's index lists to the forward's `IndexPack`,
    `bind` takes their views of the one uploaded tensor.
    """

    def __init__(
        self,
        spans: list[Span],
        last: list[int] | None,
        block_size: int,
        pack: IndexPack,
        windows: tuple[int, ...],
        positions: int | None = None,
    ) -> None:
        """`last[i]`: flat index of sequence i's last new token; None when the group is the whole
        batch in order (it then needs no token index: see `tokens`). `positions`: the batch's
        positions when the group is the whole batch of one-token slices (they are its queries').
        `windows`: the distinct sliding windows of the model's layers (a one-token group packs the
        pages each one reaches)."""
        self.num_seqs = len(spans)
        self.max_new = width = max(s.length for s in spans)
        self.max_pages = max_pages = max(len(s.pages) for s in spans)
        assert positions is None or width == 1  # only a batch of one-token slices passes them
        table: list[int] = []
        q_pos: list[int] = []  # (seqs, max_new) absolute query positions; padding repeats the last one
        slots: list[int] = []  # where each token sits in the padded (seqs * max_new) query array
        for row, s in enumerate(spans):
            # padding entries point at the sequence's first page; the mask hides them
            pages = s.pages
            table += pages
            if len(pages) < max_pages:
                table += [pages[0]] * (max_pages - len(pages))
            if positions is not None:
                continue
            if width == 1:
                q_pos.append(s.start)
            else:
                q_pos += range(s.start, s.end)
                q_pos += [s.end - 1] * (width - s.length)
                slots += range(row * width, row * width + s.length)
        self._table = pack.add(table)
        self._q_pos = pack.add(q_pos) if positions is None else positions
        self._slots = None if width == 1 else pack.add(slots)
        # flat index of each of the group's tokens, in group order (only a batch of several groups
        # scatters them)
        self._tokens: int | None = None
        if last is not None:
            tokens: list[int] = []
            for s in spans:
                tokens += range(last[s.seq] - s.length + 1, last[s.seq] + 1)
            self._tokens = pack.add(tokens)
        # A fresh group (prompts, nothing cached) attends over its own new K/V: no page gather.
        self.fresh = width > 1 and all(s.start == 0 for s in spans)
        self.uniform = self.fresh and all(s.length == width for s in spans)
        self.ctx = width if self.fresh else max_pages * block_size
        self.masks: dict[int | None, torch.Tensor] = {}
        # One-token groups: per sliding window, the pages that window can see.
        self._packed_windows = (
            {w: _pack_window(spans, w, block_size, max_pages, pack) for w in windows} if width == 1 else {}
        )
        self._windowed: dict[int, _WindowPages | None] = {}

    def bind(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Take this group's index tensors from the forward's uploaded pieces."""
        self.table = flat[self._table]
        self.q_pos = flat[self._q_pos].view(self.num_seqs, self.max_new)
        self.slots = None if self._slots is None else flat[self._slots]
        self.tokens = None if self._tokens is None else flat[self._tokens]
        for w, packed in self._packed_windows.items():
            self._windowed[w] = (
                None
                if packed is None
                else _WindowPages(flat[packed.table], packed.ctx, flat[packed.first_pos])
            )

    def windowed(self, window: int | None) -> _WindowPages | None:
        """The pages a one-token group gathers under `window` (None: every page, as without one)."""
        return None if window is None else self._windowed.get(window)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """(seqs, 1, max_new, ctx): may the query see the key (causal, within the window).

        One-token groups get an additive float mask (0 / -inf), which is faster there; longer ones a
        boolean mask, a quarter of the memory for long prompts. Under a window whose pages a
        one-token group gathers alone (`windowed`), ctx is that gather's and key positions start at
        each row's first kept page.
        """
        if window not in self.masks:
            view = self.windowed(window)
            if view is None:
                key_pos = _arange(self.ctx, self.q_pos.device)[None, None, :]  # (1, 1, ctx)
            else:  # (seqs, 1, ctx)
                key_pos = view.first_pos[:, None, None] + _arange(view.ctx, self.q_pos.device)[None, None, :]
            q_pos = self.q_pos[:, :, None]  # (seqs, max_new, 1)
            if self.max_new == 1:
                hidden = key_pos > q_pos
                if window is not None:
                    hidden |= key_pos <= q_pos - window
                minus_inf, zero = _mask_values(dtype, hidden.device)
                self.masks[window] = torch.where(hidden, minus_inf, zero)[:, None]
            else:
                allowed = key_pos <= q_pos
                if window is not None:
                    allowed &= key_pos > q_pos - window
                self.masks[window] = allowed[:, None]
        return self.masks[window]


def _pack_window(
    decodes: list[Span], window: int, block_size: int, max_pages: int, pack: IndexPack
) -> _PackedWindow | None:
    """The pages a one-token group gathers under `window`: from the page holding each query's oldest
    visible key to its own; None when that saves nothing (every page is reached somewhere).

    The first kept page of a sequence is `(q - window + 1) // block_size`; shorter rows repeat
    their last page, which the causal mask hides like the full table's padding.
    """
    firsts = [max(0, s.start - window + 1) // block_size for s in decodes]
    counts = [s.start // block_size + 1 - first for s, first in zip(decodes, firsts, strict=True)]
    if max(counts) >= max_pages:
        return None
    width = max(counts)
    table: list[int] = []
    for s, first, count in zip(decodes, firsts, counts, strict=True):
        kept = s.pages[first : first + count]
        table += kept
        table += [kept[-1]] * (width - count)
    offsets = pack.add([first * block_size for first in firsts])
    return _PackedWindow(pack.add(table), width * block_size, offsets)


class _KernelGroup:
    """Decode and resumed sequences the Triton kernel attends straight from their pages."""

    def __init__(self, spans: list[Span], last: list[int], pack: IndexPack) -> None:
        self.num_seqs = len(spans)
        self.max_pages = max_pages = max(len(s.pages) for s in spans)
        self.max_new = max(s.length for s in spans)
        rows: list[int] = []  # (seqs, 3): first new token's flat index, cached tokens, new tokens
        table: list[int] = []  # (seqs, max_pages); the padding is never read
        for s in spans:
            rows += (last[s.seq] - s.length + 1, s.start, s.length)
            table += s.pages
            table += [0] * (max_pages - len(s.pages))
        self._rows, self._table = pack.add(rows), pack.add(table)

    def bind(self, flat: tuple[torch.Tensor, ...]) -> PagedBatch:
        """The kernel's view of the forward's uploaded pieces."""
        seqs = flat[self._rows].view(self.num_seqs, 3)
        return PagedBatch(seqs, flat[self._table].view(self.num_seqs, self.max_pages), self.max_new)


@functools.lru_cache(maxsize=16)
def _windows(config: ModelConfig) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """Each layer's sliding window, and the distinct windows (memoised: read once per forward)."""
    per_layer = tuple(config.window(layer) for layer in range(config.num_layers))
    return per_layer, tuple(sorted({w for w in per_layer if w is not None}))


class AttentionContext:
    """Per-forward indices over the paged cache; `attend` is called once per layer."""

    positions: torch.Tensor  # (n,) absolute positions of the new tokens
    last_token_index: torch.Tensor  # (num_seqs,) flat index of each sequence's last new token

    token_ids: torch.Tensor | None  # (n,) the fed token ids, when `build` was given them

    def __init__(
        self,
        cache: PagedKVCache,
        config: ModelConfig,
        spans: list[Span],
        backend: Backend,
        token_ids: list[int] | None = None,
    ) -> None:
        self.cache, self.config, self.num_seqs = cache, config, len(spans)
        self.compiled = backend is Backend.COMPILED
        # decode groups through the C++ kernel (built at start for the shape the queries have;
        # `native_attention.decode` answers None where it does not apply: the torch path then)
        self.native = backend is Backend.NATIVE
        bs = cache.block_size
        page_rows = 2 * bs  # a page is block_size K rows then block_size V rows
        last: list[int] = []  # flat index of each sequence's last new token
        positions: list[int] = []
        k_rows: list[int] = []  # row of each new token's K in the layer's (blocks * 2 * block_size) rows
        decodes: list[Span] = []
        fresh: list[Span] = []
        resumed: list[Span] = []
        flat = highest = 0
        for s in spans:
            _, start, length, end, pages = s
            flat += length
            last.append(flat - 1)
            if end > highest:
                highest = end
            if length == 1:
                positions.append(start)
                k_rows.append(pages[start // bs] * page_rows + start % bs)
                decodes.append(s)
            else:
                span = range(start, end)
                positions += span
                k_rows += [pages[pos // bs] * page_rows + pos % bs for pos in span]
                (resumed if start else fresh).append(s)
        self.num_tokens = flat
        self.windows, self._sliding = _windows(config)
        pack = IndexPack()
        at_positions, at_last, at_rows = pack.add(positions), pack.add(last), pack.add(k_rows)
        at_tokens = None if token_ids is None else pack.add(token_ids)
        self.groups, kernel = self._groups(decodes, fresh, resumed, last, pack, at_positions, backend)
        indices = pack.upload(cache)  # every index list of the forward: one copy
        self.positions = indices[at_positions]
        self.last_token_index = indices[at_last]
        self.k_rows = indices[at_rows]
        self.token_ids = None if at_tokens is None else indices[at_tokens]
        self.v_rows = self.k_rows + bs  # the V block follows the K block inside a page
        for g in self.groups:
            g.bind(indices)
        self.kernel = None if kernel is None else kernel.bind(indices)
        self.cos, self.sin_signed = rotation_rows(config, self.positions, cache.dtype, highest)

    def _groups(
        self,
        decodes: list[Span],
        fresh: list[Span],
        resumed: list[Span],
        last: list[int],
        pack: IndexPack,
        positions: int,
        backend: Backend,
    ) -> tuple[list[_Group], _KernelGroup | None]:
        """The torch groups of the batch, and the kernel's group (triton: decode + resumed)."""
        bs, windows = self.cache.block_size, self._sliding
        if backend is Backend.TRITON:
            paged = decodes + resumed
            kernel = _KernelGroup(paged, last, pack) if paged else None
            return ([_Group(fresh, last if paged else None, bs, pack, windows)] if fresh else []), kernel
        parts = [g for g in (decodes, fresh, resumed) if g]
        if len(parts) == 1 and decodes:  # a decode step: the queries' positions are all the positions
            return [_Group(decodes, None, bs, pack, windows, positions)], None
        return [_Group(g, last if len(parts) > 1 else None, bs, pack, windows) for g in parts], None

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        seqs: Sequence[SeqSlice],
        config: ModelConfig,
        backend: str = "torch",
        token_ids: list[int] | None = None,
    ) -> AttentionContext:
        """Validate the slices and precompute everything the layers of one forward share.

        `token_ids` (the flat fed tokens, optional) go to the device in the same copy as the indices
        (`ctx.token_ids`), so a whole forward costs one host→device copy.

        `backend`: "torch" (the reference, and the CPU path), "triton" (decode and resumed slices
        through the paged kernel; on the CPU only under TRITON_INTERPRET=1) or "compiled" (torch,
        with one-token groups through `compiled_attention.py`'s inductor kernel; needs g++) or
        "native" (torch, with one-token groups through `native_attention.py`'s C++ kernel; needs g++).
        """
        kind = _BACKENDS.get(backend)
        if kind is None:
            raise ValueError(f"unknown attention backend {backend!r} (torch, triton, compiled or native)")
        if token_ids is not None and len(token_ids) != sum(s.length for s in seqs):
            raise InvalidArgument(f"{len(token_ids)} token ids for {sum(s.length for s in seqs)} new tokens")
        return cls(cache, config, spans(cache, seqs), kind, token_ids)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store `layer`'s new k/v (n, kv_heads, head_dim), attend q (n, heads, head_dim) over the context.

        Returns (n, heads * head_dim).
        """
        n, rows = self.num_tokens, self.cache.rows[layer]
        k, v = k.reshape(n, -1).to(rows.dtype), v.reshape(n, -1).to(rows.dtype)  # (n, kv_heads * head_dim)
        if self.native and self.kernel is None and len(self.groups) == 1:
            g = self.groups[0]
            if g.slots is None:  # a decode step: the kernel writes the new K/V rows, then attends
                table = g.table.view(g.num_seqs, g.max_pages)
                out = native_attention.decode(self.cache.layer(layer), q, table, g.q_pos[:, 0],
                                              self.windows[layer], (k, v, self.k_rows))
                if out is not None:
                    return out
        rows.index_copy_(0, self.k_rows, k)
        rows.index_copy_(0, self.v_rows, v)
        window = self.windows[layer]
        if self.kernel is None and len(self.groups) == 1:
            return self._attend_group(self.groups[0], layer, window, q, k, v)
        out = q.new_empty((n, q.shape[1] * q.shape[2]))
        if self.kernel is not None:  # writes its sequences' rows of `out` in place
            paged_attention(q, self.cache.layer(layer), self.kernel, out, window)
        for g in self.groups:
            pick = self._tokens(g)
            part = self._attend_group(g, layer, window, q[pick], k[pick], v[pick])
            out.index_copy_(0, pick, part)
        return out

    def _keys_values(
        self, g: _Group, layer: int, window: int | None, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seqs, kv_heads, ctx, head_dim) keys and values of the group's sequences."""
        kv_heads, head_dim = self.cache.num_kv_heads, self.cache.head_dim
        ctx = g.ctx
        if g.uniform:  # equal-length prompts: the new k/v are already (seqs, new) shaped
            keys, values = k, v
        elif g.fresh:  # prompts of mixed lengths: pad the new k/v
            keys = k.new_zeros((g.num_seqs * g.max_new, k.shape[1])).index_copy_(0, self._slots(g), k)
            values = v.new_zeros((g.num_seqs * g.max_new, v.shape[1])).index_copy_(0, self._slots(g), v)
        else:  # one gathered copy each of the K and V pages (under a window: only the pages it reaches)
            view = g.windowed(window)
            table = g.table if view is None else view.table
            ctx = g.ctx if view is None else view.ctx
            keys = self.cache.key_pages[layer].index_select(0, table)
            values = self.cache.value_pages[layer].index_select(0, table)
        keys = keys.view(g.num_seqs, ctx, kv_heads, head_dim).transpose(1, 2)
        values = values.view(g.num_seqs, ctx, kv_heads, head_dim).transpose(1, 2)
        return keys, values

    @staticmethod
    def _tokens(g: _Group) -> torch.Tensor:
        assert g.tokens is not None  # every group of a batch of several groups has its token index
        return g.tokens

    @staticmethod
    def _slots(g: _Group) -> torch.Tensor:
        assert g.slots is not None  # only one-token groups have no padding slots
        return g.slots

    def _attend_group(
        self, g: _Group, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv_heads, head_dim = self.cache.num_kv_heads, self.cache.head_dim
        heads = q.shape[1]
        if g.slots is None and self.native:  # pages read in place by the C++ kernel
            table = g.table.view(g.num_seqs, g.max_pages)
            out = native_attention.decode(self.cache.layer(layer), q, table, g.q_pos[:, 0], window)
            if out is not None:
                return out
        if g.slots is None and self.compiled:  # pages read in place by the generated kernel
            queries = q.reshape(g.num_seqs, kv_heads, heads // kv_heads, head_dim)
            table = g.table.view(g.num_seqs, g.max_pages)
            out = decode_attention(queries, self.cache.layer(layer), table, g.q_pos[:, 0], window)
            return out.reshape(g.num_seqs, heads * head_dim)
        keys, values = self._keys_values(g, layer, window, k, v)
        if g.slots is None:
            # One new token per sequence: no padding; the query heads sharing a KV head become that
            # head's rows, (seqs, kv_heads, group, head_dim), so K and V are never repeated.
            queries = q.reshape(g.num_seqs, kv_heads, heads // kv_heads, head_dim)
            mask = g.mask(window, queries.dtype)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
            return out.reshape(g.num_seqs, heads * head_dim)
        if g.uniform:
            queries = q.reshape(g.num_seqs, g.max_new, heads, head_dim).transpose(1, 2)
        else:
            padded = q.new_zeros((g.num_seqs * g.max_new, heads, head_dim)).index_copy_(0, g.slots, q)
            # (seqs, heads, new, head_dim)
            queries = padded.view(g.num_seqs, g.max_new, heads, head_dim).transpose(1, 2)
        causal_only = g.uniform and (window is None or window >= g.max_new)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=None if causal_only else g.mask(window, queries.dtype),
            is_causal=causal_only,
            enable_gqa=heads != kv_heads,
        )  # (seqs, heads, new, head_dim)
        out = out.transpose(1, 2).reshape(g.num_seqs * g.max_new, heads * head_dim)
        return out if g.uniform else out.index_select(0, g.slots)
