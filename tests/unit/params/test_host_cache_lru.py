"""The node's host cache (`--host-cache-bytes`): copies by model name under a byte capacity, least
recently used evicted first, a model larger than the capacity never kept, a miss is None."""

from __future__ import annotations

import pytest

from replica.params.host_cache import HostCache


def test_the_least_recently_used_copy_is_evicted_to_make_room() -> None:
    cache = HostCache(capacity=100)
    assert cache.put("a", "A", 40) and cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recently used
    assert cache.put("c", "C", 40)  # 120 > 100: b goes, not a
    assert cache.names() == ["a", "c"] and cache.get("b") is None and cache.evictions == 1
    assert cache.used == 80


def test_a_model_larger_than_the_cache_is_never_kept_and_evicts_nothing() -> None:
    cache = HostCache(capacity=100)
    cache.put("a", "A", 60)
    assert not cache.put("huge", "H", 101)
    assert cache.names() == ["a"] and cache.peek("huge") is None


def test_putting_a_model_again_replaces_its_copy_and_peek_keeps_the_order() -> None:
    cache = HostCache(capacity=100)
    cache.put("a", "A", 50)
    cache.put("b", "B", 50)
    assert cache.peek("a") == "A" and cache.names() == ["a", "b"]  # peek: no reordering
    assert cache.put("a", "A2", 50) and cache.names() == ["b", "a"] and cache.used == 100


def test_zero_is_unlimited_and_a_negative_capacity_is_refused() -> None:
    cache = HostCache()
    assert all(cache.put(str(i), i, 10**12) for i in range(5)) and cache.evictions == 0
    with pytest.raises(ValueError, match="host cache capacity must be >= 0"):
        HostCache(-1)
