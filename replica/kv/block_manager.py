"""`BlockManager`: exact accounting of the KV cache's pages, with automatic prefix caching.

A page (block) holds `block_size` tokens of K and V for every layer: all layers share the same page
ids because the cache is layer-major (`cache[layer, page]`). The manager only counts and hands out
ids; it never touches tensors, so it is tested alone in milliseconds.

Every page is in exactly one of three states:
- free: nobody holds it and it keeps nothing;
- held: `refs >= 1` holders (requests sharing a cached prefix hold the same page);
- cached: nobody holds it but it keeps a full page of K/V under its `PageHash`; a later prompt with
  that prefix takes it back (`lookup` + `allocate_many(..., shared=...)`), and an allocation that
  finds no free page evicts the least recently released cached page (its hash is reported once by
  `take_evicted`).
`num_free` counts free and cached pages (both are available to `allocate`), so "every page free"
still reads `num_free == num_blocks`; `num_cached` says how many of them are cached.

Every operation is all-or-nothing: a refused `allocate` allocates nothing, a refused `free` frees
nothing. That is what lets the engine promise "after every refused call, `num_free` equals what it
was before".
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import NewType

from replica.errors import InvalidArgument, ResourceExhausted

PageId = NewType("PageId", int)


class OutOfPages(ResourceExhausted):
    """Not enough free pages; nothing was allocated."""


class PageNotOwned(InvalidArgument):
    """A page given to `free` is not held (double free, unknown id, or listed more often than held)."""


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    if num_tokens < 0:
        raise ValueError(f"negative token count {num_tokens}")
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out page ids in [0, num_blocks) and takes them back, with exact counts (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._prefix_cache = prefix_cache
        # A stack popped from the end: the lowest ids go out first, which keeps small runs readable.
        self._free: list[PageId] = [PageId(p) for p in range(num_blocks - 1, -1, -1)]
        self._refs = [0] * num_blocks
        self._cached: OrderedDict[PageId, None] = OrderedDict()  # refs == 0, hashed; oldest first
        self._hash_of: dict[PageId, int] = {}  # every hashed page, held or cached
        self._page_of: dict[int, PageId] = {}
        self._evicted: list[int] = []

    @property
    def num_blocks(self) -> int:
        """Pages in the cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self._block_size

    @property
    def prefix_cache(self) -> bool:
        """Whether released full pages are kept by hash (`register` is a no-op otherwise)."""
        return self._prefix_cache

    @property
    def num_free(self) -> int:
        """Pages held by nobody: free or cached (both available to `allocate`)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages held by nobody but kept for their prefix (a part of `num_free`)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages held by someone."""
        return self._num_blocks - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return pages_for(num_tokens, self._block_size)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `allocate(num_pages)` would succeed now."""
        return 0 <= num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[PageId]:
        """Take `num_pages` pages (free first, then evicting cached ones, least recently used first).

        Raises `OutOfPages` (allocating nothing) if fewer than `num_pages` are free or cached.
        """
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self.num_free:
            raise OutOfPages(f"need {num_pages} KV pages, {self.num_free} of {self._num_blocks} free")
        from_free = min(num_pages, len(self._free))
        taken = self._free[len(self._free) - from_free :]
        del self._free[len(self._free) - from_free :]
        taken.reverse()
        for _ in range(num_pages - from_free):
            page, _none = self._cached.popitem(last=False)
            digest = self._hash_of.pop(page)
            del self._page_of[digest]
            self._evicted.append(digest)
            taken.append(page)
        for page in taken:
            self._refs[page] = 1
        return taken

    def allocate_many(
        self, counts: Sequence[int], shared: Sequence[Sequence[PageId]] | None = None
    ) -> list[list[PageId]]:
        """One page list per count, all or nothing; with `shared`, list i starts with `shared[i]`.

        `shared[i]` is a cached prefix found by `lookup` (pages held or cached, each then held once
        more); `counts[i]` new pages follow it. Shared pages that were cached stop being available,
        so they count against the free pages before the new ones are taken.
        """
        prefixes = [list(s) for s in shared] if shared is not None else [[] for _ in counts]
        if len(prefixes) != len(counts):
            raise ValueError(f"{len(counts)} counts but {len(prefixes)} shared prefixes")
        revived = {p for prefix in prefixes for p in prefix if self._refs[p] == 0}
        for prefix in prefixes:
            for page in prefix:
                if page not in self._hash_of:
                    raise PageNotOwned(f"page {page} is not a cached page")
        total = sum(counts)
        available = self.num_free - len(revived)
        if total > available:
            raise OutOfPages(f"need {total} KV pages, {available} of {self._num_blocks} free")
        for prefix in prefixes:
            for page in prefix:
                self._hold(page)
        return [prefix + self.allocate(count) for prefix, count in zip(prefixes, counts, strict=True)]

    def share(self, pages: Sequence[PageId]) -> None:
        """Hold each of `pages` (all held already) once more; `PageNotOwned` (nothing changed) otherwise.

        Requests of one batch sharing a prefix computed in that batch share its pages before they are
        named by a hash.
        """
        for page in set(pages):
            if not 0 <= page < self._num_blocks or self._refs[page] == 0:
                raise PageNotOwned(f"page {page} is not held: only a held page can be shared")
        for page in pages:
            self._refs[page] += 1

    def _hold(self, page: PageId) -> None:
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1

    def free(self, pages: Iterable[PageId]) -> None:
        """Release one hold on each page; raise `PageNotOwned` (releasing nothing) if one is not held.

        A page listed `k` times must be held at least `k` times. A page whose last hold goes becomes
        cached if it has a hash (most recently used), free otherwise.
        """
        pages = list(pages)
        for page, count in Counter(pages).items():
            if not 0 <= page < self._num_blocks or self._refs[page] < count:
                raise PageNotOwned(f"page {page} is not allocated (double free or unknown id)")
        for page in reversed(pages):  # a chain's last page is evicted before its first
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def is_allocated(self, page: PageId) -> bool:
        """Whether `page` is currently held."""
        return 0 <= page < self._num_blocks and self._refs[page] > 0

    def refs(self, page: PageId) -> int:
        """How many holders `page` has."""
        return self._refs[page]

    # --------------------------------------------------------------------------- prefix cache
    def lookup(self, hashes: Sequence[int]) -> list[PageId]:
        """The pages of the longest prefix of `hashes` kept (held or cached); nothing is taken."""
        found: list[PageId] = []
        if not self._prefix_cache:
            return found
        for digest in hashes:
            page = self._page_of.get(digest)
            if page is None:
                break
            found.append(page)
        return found

    def register(self, page: PageId, digest: int) -> bool:
        """Name a held page's K/V by its `PageHash`; False if the cache is off or the hash is kept elsewhere.

        A page already named keeps its name (its K/V never changes while held).
        """
        if not 0 <= page < self._num_blocks or self._refs[page] == 0:
            raise PageNotOwned(f"page {page} is not held: only a held page can be registered")
        if not self._prefix_cache:
            return False
        known = self._hash_of.get(page)
        if known is not None:
            return known == digest
        if digest in self._page_of:
            return False
        self._hash_of[page] = digest
        self._page_of[digest] = page
        return True

    def drop_cache(self) -> None:
        """Forget every hash (the K/V they name is stale): cached pages become free, held pages stay
        held but unnamed; every forgotten hash is reported by `take_evicted`."""
        self._evicted.extend(self._page_of)
        while self._cached:
            page, _none = self._cached.popitem(last=False)
            self._free.append(page)
        self._hash_of.clear()
        self._page_of.clear()

    def note_evicted(self, hashes: Iterable[int]) -> None:
        """Report `hashes` as evicted too (a previous manager's, when the cache was replaced)."""
        self._evicted.extend(hashes)

    def page_hash(self, page: PageId) -> int | None:
        """The hash `page` is kept under, if any."""
        return self._hash_of.get(page)

    def cached_hashes(self) -> list[int]:
        """Hashes of every kept page, held or cached."""
        return list(self._page_of)

    def take_evicted(self) -> list[int]:
        """Hashes evicted since the previous call (each reported once)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def check(self) -> None:
        """Assert the invariants: free + cached + held == num_blocks, maps consistent (tests use it)."""
        held = sum(1 for r in self._refs if r > 0)
        assert len(self._free) + len(self._cached) + held == self._num_blocks
        assert all(self._refs[p] == 0 and p not in self._hash_of for p in self._free)
        assert all(self._refs[p] == 0 and p in self._hash_of for p in self._cached)
        assert len(set(self._free)) == len(self._free)
        assert all(self._page_of[d] == p for p, d in self._hash_of.items())
        assert len(self._page_of) == len(self._hash_of)
