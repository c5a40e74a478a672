"""Plans, proved without moving a byte: exactly-once delivery, no early forwarding, chain(2) == p2p."""

from __future__ import annotations

import pytest

from transfer.core import Rank
from transfer.plan_check import PlanError, verify_plan
from transfer.plans import (
    Algo,
    Op,
    OpKind,
    Plan,
    TanzLayout,
    chunk_ranges,
    plan_chain,
    plan_p2p,
    plan_ring,
    plan_tanz,
    stripe_bounds,
    tanz_lane_pieces,
)


@pytest.mark.parametrize("total", [0, 1, 999, 1000, 1001, 65_537])
@pytest.mark.parametrize("ranks", [[0, 1], [3, 1, 2], [5, 4, 3, 2, 1, 0, 6, 7, 8]])
def test_chain_delivers_every_byte_once(total: int, ranks: list[int]) -> None:
    verify_plan(plan_chain(ranks, total, chunk=100))


@pytest.mark.parametrize("total", [0, 5, 1000, 4099])
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_allgather_delivers_every_byte_once(total: int, n: int) -> None:
    verify_plan(plan_ring(list(range(n)), total, chunk=64))


@pytest.mark.parametrize(
    ("sources", "dests"),
    [([0], [1]), ([0], [1, 2, 3]), ([0, 1], [2, 3]), ([0, 1], [2, 3, 4, 5]), ([0, 1, 2], [3, 4, 5, 6, 7, 8])],
)
@pytest.mark.parametrize("total", [0, 7, 600, 1000, 1234, 10_000])
def test_tanz_delivers_every_byte_once(sources: list[int], dests: list[int], total: int) -> None:
    verify_plan(plan_tanz(sources, dests, total, stripe=100, chunk=30))


def test_two_rank_chain_is_p2p() -> None:
    chain, p2p = plan_chain([4, 9], 1000, 128), plan_p2p(4, 9, 1000, 128)
    assert chain.algo is Algo.P2P
    assert chain.ops == p2p.ops
    assert [op.kind for op in chain.for_rank(4)] == [OpKind.SEND] * 8
    assert all(op.after is None for op in chain.for_rank(4))


def test_chain_middle_forwards_only_what_it_received() -> None:
    ops = plan_chain([0, 1, 2], 300, 100).for_rank(1)
    for op in ops:
        if op.kind is OpKind.SEND:
            assert op.after is not None
            source = ops[op.after]
            assert (source.kind, source.start, source.length) == (OpKind.RECV, op.start, op.length)


def test_chain_pieces_follow_the_logical_offsets() -> None:
    # the reference sent every region from the buffer start; here pieces cover distinct offsets
    starts = [op.start for op in plan_chain([0, 1], 1000, 300).for_rank(0)]
    assert starts == [0, 300, 600, 900]


def test_tanz_layout_lanes_and_rings() -> None:
    layout = TanzLayout.build([0, 1], [2, 3, 4, 5, 6, 7])
    assert layout.lanes == ((2, 3, 4), (5, 6, 7))
    assert layout.rings == ((2, 5), (3, 6), (4, 7))


def test_tanz_remainder_goes_down_lane_zero() -> None:
    assert tanz_lane_pieces(1050, 2, 100, 0) == [(0, 100), (200, 100), (400, 100), (600, 100), (800, 100),
                                                 (1000, 50)]
    assert tanz_lane_pieces(1050, 2, 100, 1)[-1] == (900, 100)


def test_tanz_sources_each_send_their_stripes_only() -> None:
    plan = plan_tanz([0, 1], [2, 3], 400, stripe=100, chunk=100)
    assert [op.start for op in plan.for_rank(0)] == [0, 200]
    assert [op.start for op in plan.for_rank(1)] == [100, 300]


@pytest.mark.parametrize(
    ("sources", "dests", "message"),
    [([0, 1], [2, 3, 4], "equal lanes"), ([0], [0, 1], "both"), ([0, 0], [1, 2], "distinct")],
)
def test_tanz_rejects_bad_groups(sources: list[int], dests: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_tanz(sources, dests, 100, 10, 10)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        plan_chain([0], 10, 10)
    with pytest.raises(ValueError, match="chunk"):
        chunk_ranges(0, 10, 0)


def test_stripe_bounds_cover_everything() -> None:
    assert stripe_bounds(10, 3) == [(0, 3), (3, 3), (6, 4)]


def _plan(ops: dict[int, list[Op]], initial: dict[int, tuple[tuple[int, int], ...]]) -> Plan:
    return Plan(Algo.CHAIN, 100, tuple(Rank(r) for r in ops), {Rank(k): v for k, v in initial.items()},
                {Rank(r): tuple(o) for r, o in ops.items()})


def test_checker_catches_forwarding_before_receiving() -> None:
    bad = _plan(
        {0: [Op(OpKind.SEND, Rank(1), 0, 100)],
         1: [Op(OpKind.SEND, Rank(2), 0, 100), Op(OpKind.RECV, Rank(0), 0, 100)],
         2: [Op(OpKind.RECV, Rank(1), 0, 100)]},
        {0: ((0, 100),)},
    )
    with pytest.raises(PlanError, match="before holding"):
        verify_plan(bad)


def test_checker_catches_duplicates_and_gaps() -> None:
    twice = _plan(
        {0: [Op(OpKind.SEND, Rank(1), 0, 100), Op(OpKind.SEND, Rank(1), 0, 100)],
         1: [Op(OpKind.RECV, Rank(0), 0, 100), Op(OpKind.RECV, Rank(0), 0, 100)]},
        {0: ((0, 100),)},
    )
    with pytest.raises(PlanError, match="twice"):
        verify_plan(twice)
    gap = _plan({0: [Op(OpKind.SEND, Rank(1), 0, 50)], 1: [Op(OpKind.RECV, Rank(0), 0, 50)]},
                {0: ((0, 100),)})
    with pytest.raises(PlanError, match="50 of 100"):
        verify_plan(gap)


def test_checker_catches_mismatched_pairs_and_cycles() -> None:
    mismatch = _plan({0: [Op(OpKind.SEND, Rank(1), 0, 100)], 1: [Op(OpKind.RECV, Rank(0), 0, 60)]},
                     {0: ((0, 100),)})
    with pytest.raises(PlanError, match="matched"):
        verify_plan(mismatch)
    cycle = _plan(
        {0: [Op(OpKind.RECV, Rank(1), 0, 100), Op(OpKind.SEND, Rank(1), 0, 100, after=0)],
         1: [Op(OpKind.RECV, Rank(0), 0, 100), Op(OpKind.SEND, Rank(0), 0, 100, after=0)]},
        {},
    )
    with pytest.raises(PlanError, match="stuck"):
        verify_plan(cycle)
