"""Cache-aware routing: the router's PageHash, its prefix index and the routing rule."""

from __future__ import annotations

import dataclasses
import random

import pytest

from replica.kv.page_hash import page_hashes as replica_page_hashes
from router.metrics import RouterMetrics
from router.page_hash import page_hash, prompt_page_hashes
from router.prefix_index import PrefixIndex
from router.prefix_routing import PrefixRouting
from router.queue import Budgets, QueueEntry, RequestQueue
from router.replicas import ReplicaState, State
from router.routing import Candidate, Routing, choose
from router.types import (
    GenerateRequest,
    ReplicaId,
    ReplicaInfo,
    RequestId,
    SamplingParams,
    StepResult,
    StoppingParams,
)

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
    cands = [Candidate(R1, 0, 2), Candidate(R2, 5, 10), Candidate(R3, 0, 1)]  # R2: 9 over R3
    assert choose(cands, Routing.CACHE_AWARE, max_load=8).replica == R3  # type: ignore[union-attr]
    # the bound is relative to the least loaded: loaded alike, the prefix wins
    busy = [Candidate(R1, 0, 12), Candidate(R2, 5, 20), Candidate(R3, 0, 13)]
    assert choose(busy, Routing.CACHE_AWARE, max_load=8).replica == R2  # type: ignore[union-attr]
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


# ---- the rule at batch time: the queue's filter -----------------------------------------------------

def _entry(rid: int, prompt: list[int]) -> QueueEntry:
    req = GenerateRequest(tuple(prompt), SamplingParams(), StoppingParams(4))
    return QueueEntry(RequestId(rid), req, lambda: True)


def _replica(rid: ReplicaId, held: int = 0) -> ReplicaState:
    info = ReplicaInfo("m", "float32", 2, 4, 64, 64, int(rid), 1024, 2048, prefix_cache=True)
    state = ReplicaState(rid, f"r{rid}", info, State.COLOCATED)
    state.held = {RequestId(1000 + i): 1 for i in range(held)}
    return state


def test_a_loop_leaves_a_prompt_cached_elsewhere_in_place_and_wakes_that_replica() -> None:
    routing = PrefixRouting(Routing.CACHE_AWARE, max_load=4, metrics=RouterMetrics())
    r1, r2 = _replica(R1), _replica(R2)
    shared = list(range(1, 9))  # two full pages of 4
    routing.index.add(R2, prompt_page_hashes(shared, 4))
    queue = RequestQueue()
    for rid, prompt in ((1, [*shared, 50]), (2, [7, 7, 7, 7, 7]), (3, [*shared, 60])):
        queue.push(_entry(rid, prompt))
    woken: list[ReplicaId] = []
    budgets = Budgets(1000, 10_000, 100, 4, 64)
    batch = queue.next_batch(budgets, routing.wants(r1, [r1, r2], woken.append))
    assert batch is not None and [e.request_id for e in batch.entries] == [2]
    assert woken == [R2] and [e.request_id for e in queue] == [1, 3]  # left in FIFO order
    batch = queue.next_batch(budgets, routing.wants(r2, [r1, r2], woken.append))
    assert batch is not None and [e.request_id for e in batch.entries] == [1, 3] and len(queue) == 0


def test_a_loaded_home_replica_or_load_routing_lets_any_loop_take_the_prompt() -> None:
    shared = list(range(1, 9))
    for routing, home_load in ((Routing.CACHE_AWARE, 5), (Routing.LOAD, 0)):
        rule = PrefixRouting(routing, max_load=4, metrics=RouterMetrics())
        rule.index.add(R2, prompt_page_hashes(shared, 4))
        r1, r2 = _replica(R1), _replica(R2, held=home_load)
        accept = rule.wants(r1, [r1, r2], lambda r: None)
        assert accept(_entry(1, [*shared, 9]))


def test_the_index_learns_from_prefills_evictions_info_and_deaths() -> None:
    metrics = RouterMetrics()
    routing = PrefixRouting(Routing.CACHE_AWARE, max_load=4, metrics=metrics)
    r1 = _replica(R1)
    hashes = prompt_page_hashes(list(range(1, 10)), 4)
    routing.info(R1, dataclasses.replace(r1.info, cached_page_hashes=hashes))
    assert routing.index.cached_pages(R1, hashes) == 2
    routing.stepped(R1, StepResult((), None, evicted_page_hashes=(hashes[0],)))
    assert routing.index.cached_pages(R1, hashes) == 0
    routing.info(R1, dataclasses.replace(r1.info, prefix_cache=False, cached_page_hashes=hashes))
    assert routing.index.pages(R1) == 0  # a replica without a prefix cache holds nothing for us
    routing.index.add(R1, hashes)
    routing.dead(R1)
    assert routing.index.pages(R1) == 0
    metrics.prefix_cache("1", 40, 32)
    assert metrics.prefix_hit_rate._value.get() == 0.8


def test_a_batchs_decode_replica_is_the_one_holding_its_prefix_when_it_has_room() -> None:
    from router.batches import Member
    from router.requests import RequestState

    rule = PrefixRouting(Routing.CACHE_AWARE, max_load=4, metrics=RouterMetrics())
    d1, d2 = (dataclasses.replace(_replica(r), _role=State.DECODE) for r in (R1, R2))
    prompt = list(range(1, 10))
    state = RequestState(RequestId(1), _entry(1, prompt).request, lambda: 0.0, None)  # type: ignore[arg-type]
    members = [Member(state, 0, state.current())]
    assert rule.destination(members, [d1, d2], 4, 2, d1) is d1  # nobody holds it: the strategy's pick
    rule.index.add(R2, prompt_page_hashes(prompt, 4))
    assert rule.destination(members, [d1, d2], 4, 2, d1) is d2
    d2.inbound = 2  # no inbound slot left on it
    assert rule.destination(members, [d1, d2], 4, 2, d1) is d1
    d2.inbound = 0
    assert rule.destination(members, [d1, d2], 100, 2, d1) is d1  # no room for the batch there
    load = PrefixRouting(Routing.LOAD, max_load=4, metrics=RouterMetrics(), index=rule.index)
    assert load.destination(members, [d1, d2], 4, 2, d1) is d1


def test_a_home_without_free_pages_for_the_prompt_does_not_hold_it_back() -> None:
    rule = PrefixRouting(Routing.CACHE_AWARE, max_load=4, metrics=RouterMetrics())
    shared = list(range(1, 9))
    rule.index.add(R2, prompt_page_hashes(shared, 4))
    r1, r2 = _replica(R1), _replica(R2)
    r2.hold({RequestId(7): 64})  # every page of r2 held
    assert rule.wants(r1, [r1, r2], lambda r: None)(_entry(1, [*shared, 9]))


def test_prompts_queued_for_a_replica_count_in_its_load() -> None:
    """A burst sharing one cached prefix: the home replica gets `max_load` of them ahead of it,
    the loop of an idle replica takes the rest rather than leave them waiting."""
    rule = PrefixRouting(Routing.CACHE_AWARE, max_load=2, metrics=RouterMetrics())
    shared = list(range(1, 9))
    rule.index.add(R2, prompt_page_hashes(shared, 4))
    r1, r2 = _replica(R1), _replica(R2)
    queue = RequestQueue()
    for rid in range(1, 7):
        queue.push(_entry(rid, [*shared, 50 + rid]))
    batch = queue.next_batch(Budgets(1000, 10_000, 100, 4, 64), rule.wants(r1, [r1, r2], lambda r: None))
    # R2 keeps the first three (loads 0, 1, 2 <= 0 + 2); R1's 0 vs R2's 3: R1 takes one, then it is
    # R2's turn again (3 <= 1 + 2), and so on
    assert batch is not None and [e.request_id for e in batch.entries] == [4, 6]
    assert [e.request_id for e in queue] == [1, 2, 3, 5]
