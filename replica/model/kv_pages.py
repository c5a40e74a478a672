"""The paged KV cache, the slices a forward reads it through, and the one upload of their indices.

```
 PagedKVCache.tensor  (layers, blocks, 2, block_size, kv_heads, head_dim)
   layer l, page p = tensor[l, p] = K block | V block (contiguous; KV migration addresses it so)
 SeqSlice(pages, start, length): tokens [start, start+length) new, [0, start) already in `pages`
 IndexPack: every index list of a forward in one host array ─► HostStaging.upload ─► one device copy
```
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch

from replica.errors import InvalidArgument
from replica.model.config import ModelConfig


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
        self._staging: HostStaging | None = None
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

    def upload(self, values: array) -> torch.Tensor:
        """`values` as a 1-D int64 tensor on the pages' device, in one copy (pinned staging on CUDA).

        The staging buffer is the cache's own: one engine's forwards run one at a time over it.
        """
        device = self._tensor.device
        if self._staging is None or self._staging.device != device:
            self._staging = HostStaging(device)
        return self._staging.upload(values)

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


class Span(NamedTuple):
    """A validated SeqSlice with its derived numbers computed once (index building is per step)."""

    seq: int  # position in the batch
    start: int
    length: int
    end: int
    pages: tuple[int, ...]  # exactly the pages the context uses


def spans(cache: PagedKVCache, seqs: Sequence[SeqSlice]) -> list[Span]:
    """Validate the slices against the cache; refuse with the sequence's number and the problem.

    The page ids of all slices are range-checked at once; on any problem `_refuse` walks the slices
    one by one to report the first faulty one, exactly as a per-slice check would.
    """
    bs, blocks = cache.block_size, cache.num_blocks
    found = []
    used: list[int] = []
    for i, (listed, start, length) in enumerate(seqs):
        end = start + length
        needed = -(-end // bs)
        if length <= 0 or start < 0 or len(listed) < needed:
            _refuse(cache, seqs)
        pages = tuple(listed[:needed])
        used += pages
        found.append(Span(i, start, length, end, pages))
    if not found or min(used) < 0 or max(used) >= blocks:
        _refuse(cache, seqs)
    return found


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


class IndexPack:
    """The index lists of one forward side by side in one host array: one upload, then views."""

    def __init__(self) -> None:
        self.values = array("q")
        self.sizes: list[int] = []

    def add(self, values: list[int]) -> int:
        """Append `values`; returns their piece number in `upload`'s result."""
        self.values.fromlist(values)  # twice as fast as extend() from a list
        self.sizes.append(len(values))
        return len(self.sizes) - 1

    def upload(self, cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
        """Every list on the cache's device (one copy), as views in the order they were added.

        One `split_with_sizes` makes every view: cheaper on the CPU than a slice per list.
        """
        return cache.upload(self.values).split_with_sizes(self.sizes)


class HostStaging:
    """Host int64 indices to one device: on CUDA through one reused, grown pinned buffer.

    A non-blocking copy out of pinned memory returns before the bytes have left it, so the buffer is
    rewritten only after the previous copy's event has completed (a step's device→host read of its
    tokens has normally waited for that long ago). On the CPU the host tensor is the result: no copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def upload(self, values: array) -> torch.Tensor:
        """A new 1-D int64 device tensor holding `values` (one host→device copy at most)."""
        host = _host_tensor(values)
        if self.device.type != "cuda":
            return host if host.device == self.device else host.to(self.device)
        staged = self._stage(host)
        on_device = staged.to(self.device, non_blocking=True)
        self._record()
        return on_device

    def copy_into(self, values: array, target: torch.Tensor) -> None:
        """Write `values` into the first len(values) elements of the 1-D int64 device tensor `target`,
        in place (its address does not change: CUDA graphs read it), in one copy."""
        host = _host_tensor(values)
        dest = target[: host.numel()]
        if self.device.type != "cuda":
            dest.copy_(host)
            return
        dest.copy_(self._stage(host), non_blocking=True)
        self._record()

    def _stage(self, host: torch.Tensor) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the pinned buffer has finished
        if host.numel() > self._pinned.numel():
            size = max(host.numel(), 2 * self._pinned.numel(), 1024)
            self._pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
        staged = self._pinned[: host.numel()]
        staged.copy_(host)
        return staged

    def _record(self) -> None:
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))


def _host_tensor(values: array) -> torch.Tensor:
    """A CPU int64 tensor over `values`' memory (keeps the array alive), no copy."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(values, dtype=torch.int64)


def as_int64(values: list[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of `values` (via a buffer: ~3x cheaper than `torch.tensor(list)` per step)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    flat = torch.frombuffer(array("q", values), dtype=torch.int64)  # keeps the array alive
    return flat if flat.device == device else flat.to(device)
