"""Cache-aware routing: the router's PageHash, its prefix index and the routing rule."""

from __future__ import annotations

import random

import pytest

from replica.kv.page_hash import page_hashes as replica_page_hashes
from router.page_hash import page_hash, prompt_page_hashes
from router.prefix_index import PrefixIndex
from router.routing import Candidate, Routing, choose
from router.types import ReplicaId

R1, R2, R3 = ReplicaId(1), ReplicaId(2), ReplicaId(3)


# ---- PageHash ---------------------------------------------------------------------------------------

def test_page_hash_equals_the_replicas_on_random_prompts() -> None:
    rng = random.Random(25)
    for _ in range(200):
        block_size = rng.choice([1, 2, 4, 16, 32])
        tokens = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 5 * block_size))]
        assert list(prompt_page_hashes(tokens, block_size)) == replica_page_hashes(tokens, block_size)


def test_page_hash_follows_the_proto_spec_byte_for_byte() -> None:
    import hashlib

    data = (7).to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3))
    assert page_hash(7, [1, 2, 3]) == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_prompt_hashes_chain_and_skip_the_partial_page() -> None:
    a = prompt_page_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2 and a[0] == page_hash(0, [1, 2]) and a[1] == page_hash(a[0], [3, 4])
    # same second page after a different first page: a different hash (it names the whole prefix)
    assert prompt_page_hashes([9, 9, 3, 4], 2)[1] != a[1]
    with pytest.raises(ValueError, match="block_size"):
        prompt_page_hashes([1], 0)


# ---- PrefixIndex ------------------------------------------------------------------------------------

def test_index_longest_prefix_stops_at_the_first_missing_page() -> None:
    idx = PrefixIndex()
    h = prompt_page_hashes(list(range(8)), 2)  # 4 pages
    idx.add(R1, h[:3])
    assert idx.cached_pages(R1, h) == 3 and idx.cached_pages(R2, h) == 0
    idx.evict(R1, [h[1]])
    assert idx.cached_pages(R1, h) == 1
    idx.reset(R1, h)
    assert idx.cached_pages(R1, h) == 4
    idx.reset(R1)
    assert idx.cached_pages(R1, h) == 0 and idx.pages(R1) == 0
    idx.add(R2, h)
    idx.drop(R2)
    assert len(idx) == 0


def test_index_is_bounded_dropping_the_least_recently_routed() -> None:
    idx = PrefixIndex(max_pages=3)
    idx.add(R1, [1, 2, 3])
    idx.add(R1, [1])  # 1 is fresh again: 2 goes first
    idx.add(R1, [4])
    assert idx.pages(R1) == 3
    assert idx.cached_pages(R1, [1]) == 1 and idx.cached_pages(R1, [2]) == 0
    with pytest.raises(ValueError):
        PrefixIndex(max_pages=0)


# ---- the rule ---------------------------------------------------------------------------------------

def test_cache_aware_picks_the_longest_cached_prefix() -> None:
    cands = [Candidate(R1, 0, 0), Candidate(R2, 5, 3), Candidate(R3, 2, 1)]
    assert choose(cands, Routing.CACHE_AWARE, max_load=8).replica == R2  # type: ignore[union-attr]


def test_cache_aware_falls_back_to_least_loaded_over_the_bound() -> None:
    cands = [Candidate(R1, 0, 2), Candidate(R2, 5, 9), Candidate(R3, 0, 1)]
    assert choose(cands, Routing.CACHE_AWARE, max_load=8).replica == R3  # type: ignore[union-attr]
    # a shorter prefix under the bound still beats no prefix
    cands.append(Candidate(ReplicaId(4), 1, 8))
    assert choose(cands, Routing.CACHE_AWARE, max_load=8).replica == ReplicaId(4)  # type: ignore[union-attr]


def test_cache_aware_without_any_prefix_is_least_loaded_and_ties_break_by_load_then_id() -> None:
    assert choose([Candidate(R2, 0, 1), Candidate(R1, 0, 1)], Routing.CACHE_AWARE, 8).replica == R1  # type: ignore[union-attr]
    assert choose([Candidate(R1, 3, 4), Candidate(R2, 3, 2)], Routing.CACHE_AWARE, 8).replica == R2  # type: ignore[union-attr]


def test_load_routing_ignores_the_cache() -> None:
    cands = [Candidate(R1, 9, 3), Candidate(R2, 0, 2)]
    assert choose(cands, Routing.LOAD, max_load=8).replica == R2  # type: ignore[union-attr]
    assert choose([], Routing.LOAD, 8) is None and choose([], Routing.CACHE_AWARE, 8) is None
