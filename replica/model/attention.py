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
(i+1)*block_size)`, and may be any block of the cache.

Queries are grouped per KV head — (seqs, kv_heads, group * new, head_dim) — so grouped-query
attention needs no repeated keys or values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.errors import InvalidArgument
from replica.model.config import ModelConfig
from replica.model.rope import rotary_rows


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


@dataclass(frozen=True)
class SeqSlice:
    """One sequence of a forward: tokens `[start, start+length)` are new, `[0, start)` already cached."""

    pages: tuple[int, ...]
    start: int
    length: int

    @property
    def end(self) -> int:
        """Total context length after this forward."""
        return self.start + self.length


def _validate(cache: PagedKVCache, seqs: Sequence[SeqSlice]) -> None:
    if not seqs:
        raise InvalidArgument("attention context needs at least one sequence")
    for i, s in enumerate(seqs):
        if s.length <= 0 or s.start < 0:
            raise InvalidArgument(f"sequence {i}: start={s.start} length={s.length} is not a valid slice")
        needed = -(-s.end // cache.block_size)
        if len(s.pages) < needed:
            raise InvalidArgument(f"sequence {i}: {s.end} tokens need {needed} pages, got {len(s.pages)}")
        if any(not 0 <= p < cache.num_blocks for p in s.pages[:needed]):
            raise InvalidArgument(f"sequence {i}: page id outside the cache's {cache.num_blocks} blocks")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Group:
    """Sequences attended together: padded to the group's longest new slice and longest context."""

    def __init__(self, seqs: list[tuple[int, SeqSlice]], flat_starts: list[int], block_size: int) -> None:
        self.num_seqs = len(seqs)
        self.max_new = max(s.length for _, s in seqs)
        self.max_pages = max(_ceil_div(s.end, block_size) for _, s in seqs)
        table: list[int] = []
        tokens: list[int] = []  # flat index of each of the group's tokens, in group order
        q_pos: list[int] = []  # (seqs, max_new) absolute query positions; padding repeats the last one
        slots: list[int] = []  # where each token sits in the padded (seqs * max_new) query array
        for row, (i, s) in enumerate(seqs):
            used = _ceil_div(s.end, block_size)
            # padding entries point at the sequence's first page; the mask hides them
            table += [*s.pages[:used], *([s.pages[0]] * (self.max_pages - used))]
            tokens += range(flat_starts[i], flat_starts[i] + s.length)
            q_pos += [min(s.start + j, s.end - 1) for j in range(self.max_new)]
            slots += range(row * self.max_new, row * self.max_new + s.length)
        self.table = torch.tensor(table, dtype=torch.int64)
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.q_pos = torch.tensor(q_pos, dtype=torch.int64).view(self.num_seqs, self.max_new)
        self.slots = None if self.max_new == 1 else torch.tensor(slots, dtype=torch.int64)
        # A fresh group (prompts, nothing cached) attends over its own new K/V: no page gather.
        self.fresh = all(s.start == 0 for _, s in seqs) and self.max_new > 1
        self.uniform = self.fresh and all(s.length == self.max_new for _, s in seqs)
        self.ctx = self.max_new if self.fresh else self.max_pages * block_size
        self.masks: dict[int | None, torch.Tensor] = {}

    def to(self, device: torch.device) -> None:
        self.table, self.tokens, self.q_pos = (
            self.table.to(device),
            self.tokens.to(device),
            self.q_pos.to(device),
        )
        self.slots = None if self.slots is None else self.slots.to(device)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """(seqs, 1, max_new, ctx): may the query see the key (causal, within the window).

        One-token groups get an additive float mask (0 / -inf), which is faster there; longer ones a
        boolean mask, a quarter of the memory for long prompts.
        """
        if window not in self.masks:
            key_pos = torch.arange(self.ctx, device=self.q_pos.device)[None, None, :]  # (1, 1, ctx)
            q_pos = self.q_pos[:, :, None]  # (seqs, max_new, 1)
            allowed = key_pos <= q_pos
            if window is not None:
                allowed &= key_pos > q_pos - window
            if self.max_new == 1:
                additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                self.masks[window] = additive.masked_fill_(~allowed, float("-inf"))[:, None]
            else:
                self.masks[window] = allowed[:, None]
        return self.masks[window]


class AttentionContext:
    """Per-forward indices over the paged cache; `attend` is called once per layer."""

    positions: torch.Tensor  # (n,) absolute positions of the new tokens
    last_token_index: torch.Tensor  # (num_seqs,) flat index of each sequence's last new token

    def __init__(self, cache: PagedKVCache, config: ModelConfig, seqs: Sequence[SeqSlice]) -> None:
        self.cache, self.config, self.seqs = cache, config, tuple(seqs)
        device = cache.tensor.device
        bs = cache.block_size
        lengths = [s.length for s in seqs]
        flat_starts = [0]
        for length in lengths:
            flat_starts.append(flat_starts[-1] + length)
        self.num_tokens = flat_starts[-1]
        positions: list[int] = []
        k_rows: list[int] = []  # row of each new token's K in the layer's (blocks * 2 * block_size) rows
        for s in seqs:
            positions += range(s.start, s.end)
            k_rows += [s.pages[pos // bs] * 2 * bs + pos % bs for pos in range(s.start, s.end)]
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.last_token_index = torch.tensor(flat_starts[1:], dtype=torch.int64, device=device) - 1
        self.k_rows = torch.tensor(k_rows, dtype=torch.int64, device=device)
        self.v_rows = self.k_rows + bs  # the V block follows the K block inside a page
        self.windows = [config.window(layer) for layer in range(config.num_layers)]
        self.groups = self._groups(flat_starts)
        for g in self.groups:
            g.to(device)
        self.cos, self.sin = rotary_rows(config, self.positions, cache.dtype)

    def _groups(self, flat_starts: list[int]) -> list[_Group]:
        decodes = [(i, s) for i, s in enumerate(self.seqs) if s.length == 1]
        fresh = [(i, s) for i, s in enumerate(self.seqs) if s.length > 1 and s.start == 0]
        resumed = [(i, s) for i, s in enumerate(self.seqs) if s.length > 1 and s.start > 0]
        bs = self.cache.block_size
        return [_Group(members, flat_starts, bs) for members in (decodes, fresh, resumed) if members]

    @classmethod
    def build(cls, cache: PagedKVCache, seqs: Sequence[SeqSlice], config: ModelConfig) -> AttentionContext:
        """Validate the slices and precompute everything the layers of one forward share."""
        _validate(cache, seqs)
        return cls(cache, config, seqs)

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
            pick = g.tokens
            part = self._attend_group(g, layer, window, q[pick], k[pick], v[pick])
            out.index_copy_(0, pick, part)
        return out

    def _keys_values(
        self, g: _Group, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seqs, kv_heads, ctx, head_dim) keys and values of the group's sequences."""
        kv_heads, head_dim = self.cache.num_kv_heads, self.cache.head_dim
        if g.uniform:  # equal-length prompts: the new k/v are already (seqs, new) shaped
            keys, values = k, v
        elif g.fresh:  # prompts of mixed lengths: pad the new k/v
            keys = k.new_zeros((g.num_seqs * g.max_new, k.shape[1])).index_copy_(0, self._slots(g), k)
            values = v.new_zeros((g.num_seqs * g.max_new, v.shape[1])).index_copy_(0, self._slots(g), v)
        else:  # one gathered copy each of the K and V pages
            keys = self.cache.key_pages[layer].index_select(0, g.table)
            values = self.cache.value_pages[layer].index_select(0, g.table)
        keys = keys.view(g.num_seqs, g.ctx, kv_heads, head_dim).transpose(1, 2)
        values = values.view(g.num_seqs, g.ctx, kv_heads, head_dim).transpose(1, 2)
        return keys, values

    @staticmethod
    def _slots(g: _Group) -> torch.Tensor:
        assert g.slots is not None  # only one-token groups have no padding slots
        return g.slots

    def _attend_group(
        self, g: _Group, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv_heads, head_dim = self.cache.num_kv_heads, self.cache.head_dim
        heads = q.shape[1]
        keys, values = self._keys_values(g, layer, k, v)
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
            queries = padded.view(g.num_seqs, g.max_new, heads, head_dim).transpose(
                1, 2
            )  # (seqs, heads, new, hd)
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
