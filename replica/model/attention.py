"""The paged KV cache and the one context object attention reads it through.

```
 flat ragged batch (n tokens)        PagedKVCache.tensor  (layers, blocks, 2, block_size, kv_heads, head_dim)
 seq0: start=0 length=5 (prefill)      layer l, page p = tensor[l, p] = K block | V block (contiguous)
 seq1: start=7 length=1 (decode)  ──►  new k/v are scattered into their slots, then each sequence's
 seq2: start=3 length=4 (resumed)      pages are gathered into a padded (seqs, ctx, kv_heads, head_dim)
                                       and one masked scaled_dot_product_attention call runs per group
```

`AttentionContext.build` precomputes, once per forward, every index and mask the layers reuse:
the cache row of each new token's K and V, and per *group* of sequences (all one-token decodes in
one group, longer slices in another, so a long prefill does not pad every decode to its length) the
flat page table, query placement and the causal (and sliding-window) masks; plus the RoPE cos/sin
rows. Pages of a sequence are listed in order; page `i` holds positions `[i*block_size,
(i+1)*block_size)`, and may be any block of the cache. Under a sliding window a decode group
gathers only the pages the window reaches: a step reads O(window) keys per sequence however long
the context (about the keys transformers' sliding cache keeps, which matters for bf16 rounding).

Queries are grouped per KV head — (seqs, kv_heads, group * new, head_dim) — so grouped-query
attention needs no repeated keys or values.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch
import torch.nn.functional as F

from replica.errors import InvalidArgument
from replica.model.config import ModelConfig
from replica.model.rope import rotation_rows


class PagedKVCache:
    """Layer-major KV pages: `tensor[l, p]` is page p of layer l, its K block then its V block."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagedKVCache dimensions must all be positive")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # (layers, blocks, K|V, block_size, kv_heads, head_dim)
        self.tensor = torch.zeros(
            (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def tensor(self) -> torch.Tensor:
        """(layers, blocks, 2, block_size, kv_heads, head_dim); assign to replace (or drop) the pages."""
        return self._tensor

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:
        # Per-layer views are made once here (attention runs every layer of every step) and dropped
        # with the tensor, so assigning an empty tensor really frees the pages:
        # rows: (blocks * 2 * block_size, kv_heads * head_dim), one row per token slot, K and V
        # blocks alternating; key/value pages: (blocks, block_size * kv_heads * head_dim), one per page.
        self._tensor = value
        shape = (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)
        full = tuple(value.shape) == shape
        layers = range(self.num_layers) if full else range(0)
        width = self.num_kv_heads * self.head_dim
        self.rows = [value[i].view(-1, width) for i in layers]
        self.key_pages = [value[i, :, 0].view(self.num_blocks, -1) for i in layers]
        self.value_pages = [value[i, :, 1].view(self.num_blocks, -1) for i in layers]

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str = "cpu"
    ) -> PagedKVCache:
        """A cache shaped for `config`."""
        return cls(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device
        )

    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.tensor.element_size()

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers (for sizing the cache from a memory budget)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize

    def layer(self, index: int) -> torch.Tensor:
        """All pages of layer `index`: (blocks, 2, block_size, kv_heads, head_dim)."""
        return self.tensor[index]


class SeqSlice(NamedTuple):  # built per sequence per forward: cheaper than a dataclass
    """One sequence of a forward: tokens `[start, start+length)` are new, `[0, start)` already cached."""

    pages: Sequence[int]  # at least the pages the context uses (the rest is ignored)
    start: int
    length: int

    @property
    def end(self) -> int:
        """Total context length after this forward."""
        return self.start + self.length


class _Span(NamedTuple):
    """A validated SeqSlice with its derived numbers computed once (index building is per step)."""

    seq: int  # position in the batch
    start: int
    length: int
    end: int
    pages: tuple[int, ...]  # exactly the pages the context uses


def _spans(cache: PagedKVCache, seqs: Sequence[SeqSlice]) -> list[_Span]:
    """Validate the slices against the cache; refuse with the sequence's number and the problem.

    The page ids of all slices are range-checked at once; on any problem `_refuse` walks the slices
    one by one to report the first faulty one, exactly as a per-slice check would.
    """
    bs, blocks = cache.block_size, cache.num_blocks
    spans = []
    used: list[int] = []
    for i, (listed, start, length) in enumerate(seqs):
        end = start + length
        needed = -(-end // bs)
        if length <= 0 or start < 0 or len(listed) < needed:
            _refuse(cache, seqs)
        pages = tuple(listed[:needed])
        used += pages
        spans.append(_Span(i, start, length, end, pages))
    if not spans or min(used) < 0 or max(used) >= blocks:
        _refuse(cache, seqs)
    return spans


def _refuse(cache: PagedKVCache, seqs: Sequence[SeqSlice]) -> NoReturn:
    """Raise InvalidArgument for the first faulty slice (the caller found one)."""
    if not seqs:
        raise InvalidArgument("attention context needs at least one sequence")
    bs, blocks = cache.block_size, cache.num_blocks
    for i, (listed, start, length) in enumerate(seqs):
        end = start + length
        if length <= 0 or start < 0:
            raise InvalidArgument(f"sequence {i}: start={start} length={length} is not a valid slice")
        needed = -(-end // bs)
        if len(listed) < needed:
            raise InvalidArgument(f"sequence {i}: {end} tokens need {needed} pages, got {len(listed)}")
        pages = listed[:needed]
        if min(pages) < 0 or max(pages) >= blocks:
            raise InvalidArgument(f"sequence {i}: page id outside the cache's {blocks} blocks")
    raise AssertionError("_refuse found no faulty slice")


def as_int64(values: list[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of `values` (via a buffer: ~3x cheaper than `torch.tensor(list)` per step)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    flat = torch.frombuffer(array("q", values), dtype=torch.int64)  # keeps the array alive
    return flat if flat.device == device else flat.to(device)


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


class _Group:
    """Sequences attended together: padded to the group's longest new slice and longest context."""

    def __init__(
        self,
        spans: list[_Span],
        last: list[int] | None,
        block_size: int,
        device: torch.device,
        positions: torch.Tensor | None = None,
    ) -> None:
        """`last[i]`: flat index of sequence i's last new token; None when the group is the whole
        batch in order (it then needs no token index: see `tokens`). `positions`: the batch's
        positions when the group is the whole batch of one-token slices (they are its queries')."""
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
        self.table = as_int64(table, device)
        self.q_pos = (as_int64(q_pos, device) if positions is None else positions).view(self.num_seqs, width)
        self.slots = None if width == 1 else as_int64(slots, device)
        # flat index of each of the group's tokens, in group order (only a batch of several groups
        # scatters them)
        self.tokens: torch.Tensor | None = None
        if last is not None:
            tokens: list[int] = []
            for s in spans:
                tokens += range(last[s.seq] - s.length + 1, last[s.seq] + 1)
            self.tokens = as_int64(tokens, device)
        # A fresh group (prompts, nothing cached) attends over its own new K/V: no page gather.
        self.fresh = width > 1 and all(s.start == 0 for s in spans)
        self.uniform = self.fresh and all(s.length == width for s in spans)
        self.ctx = width if self.fresh else max_pages * block_size
        self.masks: dict[int | None, torch.Tensor] = {}
        # One-token groups: per sliding window, the pages that window can see (built on first use).
        self._decodes = spans if width == 1 else []
        self._block_size = block_size
        self._windowed: dict[int, _WindowPages | None] = {}

    def windowed(self, window: int | None) -> _WindowPages | None:
        """The pages a one-token group gathers under `window`: from the page holding each query's
        oldest visible key to its own (None: every page, as without a window; then nothing is saved).

        The first kept page of a sequence is `(q - window + 1) // block_size`; shorter rows repeat
        their last page, which the causal mask hides like the full table's padding.
        """
        if window is None or not self._decodes:
            return None
        if window not in self._windowed:
            bs = self._block_size
            firsts = [max(0, s.start - window + 1) // bs for s in self._decodes]
            counts = [s.start // bs + 1 - first for s, first in zip(self._decodes, firsts, strict=True)]
            if max(counts) >= self.max_pages:
                self._windowed[window] = None
            else:
                width = max(counts)
                table: list[int] = []
                for s, first, count in zip(self._decodes, firsts, counts, strict=True):
                    kept = s.pages[first : first + count]
                    table += kept
                    table += [kept[-1]] * (width - count)
                device = self.q_pos.device
                offsets = as_int64([first * bs for first in firsts], device)
                self._windowed[window] = _WindowPages(as_int64(table, device), width * bs, offsets)
        return self._windowed[window]

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


@functools.lru_cache(maxsize=16)
def _windows(config: ModelConfig) -> tuple[int | None, ...]:
    return tuple(config.window(layer) for layer in range(config.num_layers))


class AttentionContext:
    """Per-forward indices over the paged cache; `attend` is called once per layer."""

    positions: torch.Tensor  # (n,) absolute positions of the new tokens
    last_token_index: torch.Tensor  # (num_seqs,) flat index of each sequence's last new token

    def __init__(self, cache: PagedKVCache, config: ModelConfig, spans: list[_Span]) -> None:
        self.cache, self.config, self.num_seqs = cache, config, len(spans)
        device = cache.tensor.device
        bs = cache.block_size
        page_rows = 2 * bs  # a page is block_size K rows then block_size V rows
        last: list[int] = []  # flat index of each sequence's last new token
        positions: list[int] = []
        k_rows: list[int] = []  # row of each new token's K in the layer's (blocks * 2 * block_size) rows
        decodes: list[_Span] = []
        fresh: list[_Span] = []
        resumed: list[_Span] = []
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
        self.positions = as_int64(positions, device)
        self.last_token_index = as_int64(last, device)
        self.k_rows = as_int64(k_rows, device)
        self.v_rows = self.k_rows + bs  # the V block follows the K block inside a page
        self.windows = _windows(config)
        parts = [g for g in (decodes, fresh, resumed) if g]
        if len(parts) == 1 and decodes:  # a decode step: the queries' positions are all the positions
            self.groups = [_Group(decodes, None, bs, device, self.positions)]
        else:
            self.groups = [_Group(g, last if len(parts) > 1 else None, bs, device) for g in parts]
        self.cos, self.sin_signed = rotation_rows(config, self.positions, cache.dtype, highest)

    @classmethod
    def build(cls, cache: PagedKVCache, seqs: Sequence[SeqSlice], config: ModelConfig) -> AttentionContext:
        """Validate the slices and precompute everything the layers of one forward share."""
        return cls(cache, config, _spans(cache, seqs))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store `layer`'s new k/v (n, kv_heads, head_dim), attend q (n, heads, head_dim) over the context.

        Returns (n, heads * head_dim).
        """
        n, rows = self.num_tokens, self.cache.rows[layer]
        k, v = k.reshape(n, -1).to(rows.dtype), v.reshape(n, -1).to(rows.dtype)  # (n, kv_heads * head_dim)
        rows.index_copy_(0, self.k_rows, k)
        rows.index_copy_(0, self.v_rows, v)
        window = self.windows[layer]
        if len(self.groups) == 1:
            return self._attend_group(self.groups[0], layer, window, q, k, v)
        out = q.new_empty((n, q.shape[1] * q.shape[2]))
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
