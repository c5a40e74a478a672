"""Check a plan without moving a byte: simulate it and prove its delivery properties.

`verify_plan` replays every rank's ops with per-edge FIFO matching (as the fabrics do) and raises
`PlanError` unless: matched SEND/RECV pairs agree on the bytes, nobody sends bytes it does not hold
yet (a forward waits for its own receive), every receiver gets every byte of `[0, total)` exactly
once, and the plan finishes (no cyclic waits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from transfer.core import Rank
from transfer.plans import Op, OpKind, Plan


class PlanError(AssertionError):
    """The plan violates a delivery property."""


@dataclass
class _Cursor:
    """Per-edge FIFO of op indices, for one rank."""

    sends: dict[Rank, deque[int]]
    recvs: dict[Rank, deque[int]]


def _cursors(plan: Plan) -> dict[Rank, _Cursor]:
    cursors: dict[Rank, _Cursor] = {}
    for rank in plan.ranks:
        cursor = _Cursor({}, {})
        for index, op in enumerate(plan.for_rank(rank)):
            table = cursor.sends if op.kind is OpKind.SEND else cursor.recvs
            table.setdefault(op.peer, deque()).append(index)
        cursors[rank] = cursor
    return cursors


class _Simulation:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cursors = _cursors(plan)
        self.done: dict[Rank, set[int]] = {r: set() for r in plan.ranks}
        self.held: dict[Rank, list[tuple[int, int]]] = {r: list(plan.initial.get(r, ())) for r in plan.ranks}

    def holds(self, rank: Rank, start: int, length: int) -> bool:
        return any(s <= start and start + length <= s + n for s, n in self.held[rank])

    def ready(self, rank: Rank, op: Op) -> bool:
        if op.after is None:
            return True
        return op.after in self.done[rank]

    def step(self) -> bool:
        """Match every ready head-of-edge pair once; return whether anything moved."""
        moved = False
        for src in self.plan.ranks:
            for dst, queue in self.cursors[src].sends.items():
                if queue and self._try(src, dst, queue):
                    moved = True
        return moved

    def _try(self, src: Rank, dst: Rank, sends: deque[int]) -> bool:
        send = self.plan.for_rank(src)[sends[0]]
        recvs = self.cursors[dst].recvs.get(src)
        if not recvs:
            raise PlanError(f"rank {src} sends {send} but rank {dst} posts no receive from it")
        if not self.ready(src, send):
            return False
        recv = self.plan.for_rank(dst)[recvs[0]]
        if (recv.start, recv.length) != (send.start, send.length):
            raise PlanError(f"{src}->{dst}: send {send} matched receive {recv}")
        self._check_forward(src, send)
        if self.holds(dst, send.start, send.length) and send.length:
            raise PlanError(f"rank {dst} receives [{send.start}, +{send.length}) twice")
        self.held[dst].append((send.start, send.length))
        self.done[src].add(sends.popleft())
        self.done[dst].add(recvs.popleft())
        return True

    def _check_forward(self, src: Rank, send: Op) -> None:
        if send.after is not None:
            source = self.plan.for_rank(src)[send.after]
            if source.kind is not OpKind.RECV or (source.start, source.length) != (send.start, send.length):
                raise PlanError(f"rank {src} forwards {send} after unrelated op {source}")
        elif not any(s <= send.start and send.start + send.length <= s + n
                     for s, n in self.plan.initial.get(src, ())):
            # without `after`, the executor posts the send at once: the bytes must be there from the start
            raise PlanError(f"rank {src} sends [{send.start}, +{send.length}) before holding it")


def verify_plan(plan: Plan) -> None:
    """Raise `PlanError` unless the plan delivers every byte exactly once to every receiver."""
    sim = _Simulation(plan)
    while sim.step():
        pass
    for rank in plan.ranks:
        left = len(plan.for_rank(rank)) - len(sim.done[rank])
        if left:
            raise PlanError(f"rank {rank} is stuck with {left} ops that can never complete")
    for rank in plan.ranks:
        if plan.receives(rank) or rank not in plan.initial:
            _check_complete(rank, sim.held[rank], plan.total)


def _check_complete(rank: Rank, held: list[tuple[int, int]], total: int) -> None:
    position = 0
    for start, length in sorted(held):
        if start != position:
            problem = "overlap" if start < position else "gap"
            raise PlanError(f"rank {rank}: {problem} at byte {min(start, position)}")
        position = start + length
    if position != total:
        raise PlanError(f"rank {rank} ends with {position} of {total} bytes")
