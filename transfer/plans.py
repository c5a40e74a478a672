"""Transfer plans: pure functions saying which rank sends which byte range to whom, in what order.

Plans live in a *logical* byte space `[0, total)`: the concatenation of the caller's regions. Each
rank maps logical ranges onto its own buffer (its regions may sit at other offsets), so the same plan
serves weights (identical layouts) and KV pages (different pages on each side).

Each rank gets an ordered tuple of `Op`s. Ops between one pair of ranks are listed in the same order
on both sides (that is how messages match); a forwarding SEND names the RECV it waits for (`after`).
No I/O, no threads: `transfer.plan_check` verifies a plan without moving a byte.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from transfer.core import Rank


class Algo(enum.StrEnum):
    """The collective algorithms."""

    P2P = "p2p"
    CHAIN = "chain"
    TANZ = "tanz"
    RING = "ring"


class OpKind(enum.Enum):
    """Direction of one op."""

    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class Op:
    """Send or receive logical bytes `[start, start + length)` to/from `peer`."""

    kind: OpKind
    peer: Rank
    start: int
    length: int
    after: int | None = None  # index (in the same rank's ops) of the RECV that must complete first


@dataclass(frozen=True)
class Plan:
    """A whole collective: every rank's ops, plus what each rank holds before it starts."""

    algo: Algo
    total: int
    ranks: tuple[Rank, ...]  # every participant; ranks[0] is the leader that confirms completion
    initial: Mapping[Rank, tuple[tuple[int, int], ...]]  # logical (start, length) held at the start
    ops: Mapping[Rank, tuple[Op, ...]] = field(repr=False)

    def for_rank(self, rank: int) -> tuple[Op, ...]:
        """The ops of `rank` (empty if it takes no part)."""
        return self.ops.get(Rank(rank), ())

    def peers(self, rank: int) -> set[Rank]:
        """Every rank that `rank` exchanges bytes with."""
        return {op.peer for op in self.for_rank(rank)}

    def receives(self, rank: int) -> bool:
        """Whether `rank` receives any byte in this plan."""
        return any(op.kind is OpKind.RECV for op in self.for_rank(rank))


def chunk_ranges(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """`[start, end)` cut into (start, length) pieces of at most `chunk` bytes."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return [(s, min(chunk, end - s)) for s in range(start, end, chunk)]


def _check_ranks(ranks: Sequence[int], minimum: int) -> tuple[Rank, ...]:
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {list(ranks)}")
    if len(ranks) < minimum:
        raise ValueError(f"need at least {minimum} ranks, got {list(ranks)}")
    return tuple(Rank(r) for r in ranks)


class _Builder:
    """Accumulates per-rank op lists and remembers where each (rank, piece) was received."""

    def __init__(self, ranks: Sequence[Rank]) -> None:
        self.ops: dict[Rank, list[Op]] = {r: [] for r in ranks}
        self.received: dict[tuple[Rank, int], int] = {}  # (rank, piece start) -> recv op index

    def transfer(self, src: Rank, dst: Rank, piece: tuple[int, int], forward: bool) -> None:
        """Add the matching SEND (waiting for src's own RECV of the piece if `forward`) and RECV."""
        start, length = piece
        after = self.received[(src, start)] if forward else None
        self.ops[src].append(Op(OpKind.SEND, dst, start, length, after))
        self.received[(dst, start)] = len(self.ops[dst])
        self.ops[dst].append(Op(OpKind.RECV, src, start, length))

    def plan(self, algo: Algo, total: int, ranks: tuple[Rank, ...], initial: dict) -> Plan:
        return Plan(algo, total, ranks, initial, {r: tuple(ops) for r, ops in self.ops.items()})


def plan_chain(ranks: Sequence[int], total: int, chunk: int) -> Plan:
    """Chain multicast: ranks[0] holds the bytes; each chunk flows down the chain, store-and-forward."""
    chain = _check_ranks(ranks, 2)
    builder = _Builder(chain)
    for piece in chunk_ranges(0, total, chunk):
        for i in range(len(chain) - 1):
            builder.transfer(chain[i], chain[i + 1], piece, forward=i > 0)
    algo = Algo.P2P if len(chain) == 2 else Algo.CHAIN
    return builder.plan(algo, total, chain, {chain[0]: ((0, total),)})


def plan_p2p(src: int, dst: int, total: int, chunk: int) -> Plan:
    """Point to point: a chain of two."""
    return plan_chain([src, dst], total, chunk)


def stripe_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """`[0, total)` cut into `parts` contiguous, near-equal (start, length) stripes."""
    cuts = [total * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts)]


def plan_ring(ranks: Sequence[int], total: int, chunk: int) -> Plan:
    """Ring all-gather: rank i holds stripe i; n-1 steps of send-to-next / receive-from-previous."""
    ring = _check_ranks(ranks, 2)
    n = len(ring)
    stripes = stripe_bounds(total, n)
    builder = _Builder(ring)
    for step in range(n - 1):
        for i in range(n):
            start, length = stripes[(i - step) % n]
            for piece in chunk_ranges(start, start + length, chunk):
                builder.transfer(ring[i], ring[(i + 1) % n], piece, forward=step > 0)
    initial = {ring[i]: (stripes[i],) for i in range(n)}
    return builder.plan(Algo.RING, total, ring, initial)


@dataclass(frozen=True)
class TanzLayout:
    """Who is where in a Tanz broadcast: lanes (chains) and rings (same position in every lane)."""

    sources: tuple[Rank, ...]
    lanes: tuple[tuple[Rank, ...], ...]  # lane j: the destinations fed by sources[j], in chain order
    rings: tuple[tuple[Rank, ...], ...]  # ring p: lanes[j][p] for every lane j, in lane order

    @classmethod
    def build(cls, sources: Sequence[int], dests: Sequence[int]) -> TanzLayout:
        """Split `dests` into len(sources) lanes of equal length."""
        srcs = _check_ranks(sources, 1)
        dsts = _check_ranks(dests, 1)
        if set(srcs) & set(dsts):
            raise ValueError("a rank cannot be both a Tanz source and a destination")
        if len(dsts) % len(srcs):
            raise ValueError(f"{len(dsts)} destinations do not split into {len(srcs)} equal lanes")
        per_lane = len(dsts) // len(srcs)
        lanes = tuple(dsts[j * per_lane : (j + 1) * per_lane] for j in range(len(srcs)))
        rings = tuple(tuple(lane[p] for lane in lanes) for p in range(per_lane))
        return cls(srcs, lanes, rings)


def tanz_lane_pieces(total: int, lanes: int, stripe: int, lane: int) -> list[tuple[int, int]]:
    """Logical ranges lane `lane` carries: its stripe of every full segment (+ the remainder for lane 0)."""
    segment = lanes * stripe
    full = total // segment
    ranges = [(g * segment + lane * stripe, stripe) for g in range(full)]
    if lane == 0 and total > full * segment:
        ranges.append((full * segment, total - full * segment))
    return ranges


def plan_tanz(sources: Sequence[int], dests: Sequence[int], total: int, stripe: int, chunk: int) -> Plan:
    """Tanz: lane j carries stripe j of every segment down its chain, then rings all-gather the stripes."""
    if stripe <= 0:
        raise ValueError(f"stripe must be positive, got {stripe}")
    layout = TanzLayout.build(sources, dests)
    s = len(layout.sources)
    everyone = layout.sources + tuple(r for lane in layout.lanes for r in lane)
    builder = _Builder(everyone)
    for j, lane in enumerate(layout.lanes):
        chain = (layout.sources[j], *lane)
        for start, length in tanz_lane_pieces(total, s, stripe, j):
            for piece in chunk_ranges(start, start + length, chunk):
                for i in range(len(chain) - 1):
                    builder.transfer(chain[i], chain[i + 1], piece, forward=i > 0)
    for ring in layout.rings:
        _tanz_ring(builder, ring, total, stripe, chunk)
    initial = {src: ((0, total),) for src in layout.sources}
    return builder.plan(Algo.TANZ, total, everyone, initial)


def _tanz_ring(builder: _Builder, ring: tuple[Rank, ...], total: int, stripe: int, chunk: int) -> None:
    s = len(ring)
    segment = s * stripe
    for g in range(total // segment):
        for step in range(s - 1):
            for j in range(s):
                start = g * segment + ((j - step) % s) * stripe
                for piece in chunk_ranges(start, start + stripe, chunk):
                    builder.transfer(ring[j], ring[(j + 1) % s], piece, forward=True)
    remainder = (total // segment) * segment
    for piece in chunk_ranges(remainder, total, chunk):
        for j in range(s - 1):  # lane 0's member passes the remainder around the ring
            builder.transfer(ring[j], ring[j + 1], piece, forward=True)
