"""`PageHash`: the prefix cache's key, computed alike by the replica and the router.

A full page of `block_size` token ids `t_0..t_{B-1}` whose predecessor page has hash `parent`
(0 for the first page) has the hash: the little-endian uint64 of BLAKE2b(digest_size=8) over
`parent` as 8 little-endian bytes followed by each `t_i` as 4 little-endian bytes (the `PageHash`
comment in `protos/generate.proto`). The chain makes a page's hash name its whole prefix, so equal
hashes mean equal K/V. A partial last page has no hash and is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full page of `tokens` after a page hashed `parent` (0 for the first page)."""
    data = struct.pack(f"<Q{len(tokens)}I", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def page_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: int = 0) -> list[int]:
    """Hashes of the full pages of `tokens` from page index `start` on, the chain resumed at `parent`.

    `parent` must be the hash of page `start - 1` (0 when `start` is 0).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = []
    for first in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = page_hash(parent, tokens[first : first + block_size])
        hashes.append(parent)
    return hashes
