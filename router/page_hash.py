"""`PageHash` on the router's side: the chained hash naming a full page of prompt tokens.

The router may not import the replica's packages, so it computes the hash itself, exactly as the
`PageHash` comment of `protos/generate.proto` defines it (and as the replica's `replica/kv` does; a
unit test checks the two agree): a full page of `block_size` token ids `t_0..t_{B-1}` after a page
hashed `parent` (0 for the first page) hashes to the little-endian uint64 of BLAKE2b(digest_size=8)
over `parent` as 8 little-endian bytes followed by each `t_i` as 4 little-endian bytes. A partial
last page has no hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full page of `tokens` after a page hashed `parent` (0 for the first page)."""
    data = struct.pack(f"<Q{len(tokens)}I", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_page_hashes(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chained hashes of every full page of `tokens`, first page first."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = 0
    for first in range(0, len(tokens) - block_size + 1, block_size):
        parent = page_hash(parent, tokens[first : first + block_size])
        hashes.append(parent)
    return tuple(hashes)
