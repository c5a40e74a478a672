"""`BlockManager`: exact accounting of the KV cache's pages.

A page (block) holds `block_size` tokens of K and V for every layer: all layers share the same page
ids because the cache is layer-major (`cache[layer, page]`). The manager only counts and hands out
ids; it never touches tensors, so it is tested alone in milliseconds.

Every operation is all-or-nothing: a refused `allocate` allocates nothing, a refused `free` frees
nothing. That is what lets the engine promise "after every refused call, `num_free` equals what it
was before".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NewType

from replica.errors import InvalidArgument, ResourceExhausted

PageId = NewType("PageId", int)


class OutOfPages(ResourceExhausted):
    """Not enough free pages; nothing was allocated."""


class PageNotOwned(InvalidArgument):
    """A page given to `free` is not allocated (double free, unknown id, or listed twice)."""


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    if num_tokens < 0:
        raise ValueError(f"negative token count {num_tokens}")
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out page ids in [0, num_blocks) and takes them back, with exact counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # A stack popped from the end: the lowest ids go out first, which keeps small runs readable.
        self._free: list[PageId] = [PageId(p) for p in range(num_blocks - 1, -1, -1)]
        self._allocated = [False] * num_blocks

    @property
    def num_blocks(self) -> int:
        """Pages in the cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self._block_size

    @property
    def num_free(self) -> int:
        """Pages not owned by anyone."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages owned by someone."""
        return self._num_blocks - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return pages_for(num_tokens, self._block_size)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `allocate(num_pages)` would succeed now."""
        return 0 <= num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[PageId]:
        """Take `num_pages` free pages; raise `OutOfPages` (allocating nothing) if there are fewer."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            raise OutOfPages(f"need {num_pages} KV pages, {len(self._free)} of {self._num_blocks} free")
        taken = self._free[len(self._free) - num_pages :]
        del self._free[len(self._free) - num_pages :]
        taken.reverse()
        for page in taken:
            self._allocated[page] = True
        return taken

    def allocate_many(self, counts: Sequence[int]) -> list[list[PageId]]:
        """Allocate one page list per count, all or nothing."""
        total = sum(counts)
        if total > len(self._free):
            raise OutOfPages(f"need {total} KV pages, {len(self._free)} of {self._num_blocks} free")
        return [self.allocate(count) for count in counts]

    def free(self, pages: Iterable[PageId]) -> None:
        """Give pages back; raise `PageNotOwned` (freeing nothing) if any is not allocated or repeated."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if not 0 <= page < self._num_blocks or not self._allocated[page] or page in seen:
                raise PageNotOwned(f"page {page} is not allocated (double free or unknown id)")
            seen.add(page)
        for page in reversed(pages):
            self._allocated[page] = False
            self._free.append(page)

    def is_allocated(self, page: PageId) -> bool:
        """Whether `page` is currently owned."""
        return 0 <= page < self._num_blocks and self._allocated[page]
