"""The paged KV cache and the one context object attention reads it through.

```
 flat ragged batch (n tokens)        PagedKVCache.tensor  (layers, blocks, 2, block_size, kv_heads, head_dim)
 seq0: start=0 length=5 (prefill)      layer l, page p = tensor[l, p] = K block | V block (contiguous)
 seq1: start=7 length=1 (decode)  ──►  new k/v are scattered into their slots, then each sequence's
 seq2: start=3 length=4 (resumed)      pages are gathered into a padded (seqs, ctx, kv_heads, head_dim)
                                       and one masked scaled_dot_product_attention call runs per layer
```

`AttentionContext.build` precomputes, once per forward, every index and mask the layers reuse:
slot of each new token, the padded page table, query scatter indices, the causal (and sliding
window) masks, and the RoPE cos/sin tables. Pages of a sequence are listed in order; page `i`
holds positions `[i*block_size, (i+1)*block_size)`, and may be any block of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.errors import InvalidArgument
from replica.model.config import ModelConfig
from replica.model.rope import cos_sin, inverse_frequencies


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


class AttentionContext:
    """Per-forward indices over the paged cache; `attend` is called once per layer."""

    positions: torch.Tensor  # (n,) absolute positions of the new tokens
    last_token_index: torch.Tensor  # (num_seqs,) flat index of each sequence's last new token

    def __init__(self, cache: PagedKVCache, config: ModelConfig, seqs: Sequence[SeqSlice]) -> None:
        self.cache, self.config, self.seqs = cache, config, tuple(seqs)
        device = cache.tensor.device
        bs = cache.block_size
        lengths = torch.tensor([s.length for s in seqs], dtype=torch.int64)
        starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
        self.num_tokens = int(lengths.sum())
        self.max_new = int(lengths.max())
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), lengths)  # (n,)
        offset_in_seq = torch.arange(self.num_tokens) - torch.repeat_interleave(
            lengths.cumsum(0) - lengths, lengths
        )
        positions = starts[seq_of_token] + offset_in_seq
        self.positions = positions.to(device)
        self.last_token_index = (lengths.cumsum(0) - 1).to(device)
        # padded page table: (seqs, max_pages); unused entries point at page 0 and are masked out
        self.max_pages = max(-(-s.end // bs) for s in seqs)
        table = torch.zeros((len(seqs), self.max_pages), dtype=torch.int64)
        for i, s in enumerate(seqs):
            used = -(-s.end // bs)
            table[i, :used] = torch.tensor(s.pages[:used], dtype=torch.int64)
        self.page_table = table.to(device)
        # (page, offset in page) where each new token's k/v is written
        self.slot_page = table[seq_of_token, positions // bs].to(device)
        self.slot_offset = (positions % bs).to(device)
        # where each flat token sits in the padded (seqs * max_new) query array
        self.query_index = (seq_of_token * self.max_new + offset_in_seq).to(device)
        self._q_pos = self._padded_query_positions(starts, lengths).to(device)
        self._masks: dict[int | None, torch.Tensor] = {}
        inv_freq, scale = inverse_frequencies(config)
        self.cos, self.sin = cos_sin(inv_freq, scale, self.positions, cache.dtype)

    @classmethod
    def build(cls, cache: PagedKVCache, seqs: Sequence[SeqSlice], config: ModelConfig) -> AttentionContext:
        """Validate the slices and precompute everything the layers of one forward share."""
        _validate(cache, seqs)
        return cls(cache, config, seqs)

    def _padded_query_positions(self, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # (seqs, max_new): absolute position of each padded query; padding rows get the last real one
        offsets = torch.arange(self.max_new)[None, :].expand(len(self.seqs), -1)
        offsets = torch.minimum(offsets, (lengths - 1)[:, None])
        return starts[:, None] + offsets

    def _mask(self, window: int | None) -> torch.Tensor:
        """(seqs, 1, max_new, ctx) boolean: may query attend to key (causal, within the window)."""
        if window not in self._masks:
            ctx = self.max_pages * self.cache.block_size
            key_pos = torch.arange(ctx, device=self._q_pos.device)[None, None, :]  # (1, 1, ctx)
            q_pos = self._q_pos[:, :, None]  # (seqs, max_new, 1)
            allowed = key_pos <= q_pos
            if window is not None:
                allowed &= key_pos > q_pos - window
            self._masks[window] = allowed[:, None]  # broadcast over heads
        return self._masks[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store `layer`'s new k/v (n, kv_heads, head_dim), attend q (n, heads, head_dim) over the context.

        Returns (n, heads * head_dim).
        """
        pages = self.cache.layer(layer)  # (blocks, 2, block_size, kv_heads, head_dim)
        kv_heads, head_dim = pages.shape[3], pages.shape[4]
        pages[self.slot_page, 0, self.slot_offset] = k.to(pages.dtype)  # in place: index_put_ on a view
        pages[self.slot_page, 1, self.slot_offset] = v.to(pages.dtype)
        num_seqs = len(self.seqs)
        gathered = pages[self.page_table]  # (seqs, max_pages, 2, block_size, kv_heads, head_dim)
        keys = (
            gathered[:, :, 0].reshape(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
        )  # (seqs, kv, ctx, hd)
        values = gathered[:, :, 1].reshape(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
        heads = q.shape[1]
        queries = q.new_zeros((num_seqs * self.max_new, heads, head_dim))
        queries[self.query_index] = q
        queries = queries.view(num_seqs, self.max_new, heads, head_dim).transpose(
            1, 2
        )  # (seqs, heads, new, hd)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=self._mask(self.config.window(layer)),
            enable_gqa=heads != kv_heads,
        )  # (seqs, heads, new, hd)
        out = out.transpose(1, 2).reshape(num_seqs * self.max_new, heads * head_dim)
        return out[self.query_index]
