"""Runs one rank's part of a plan on a fabric: per-edge windows, dependencies, region callbacks.

Ops to one peer in one direction form an edge, posted strictly in plan order (that is how the two
sides match) with at most `window` outstanding. A forwarding SEND is posted only once the RECV it
depends on has completed. Completions arrive on a queue from the fabric's threads; the callbacks
(`on_region(index)`) run on the caller's thread, once per region this rank receives, when every
chunk of that region is in place. On any failure or deadline the executor aborts every edge of
the plan, so that peers fail fast instead of waiting out their deadlines.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from transfer.core import Deadline, Handle, Rank
from transfer.errors import PeerTimeout, TransferError
from transfer.fabric import Fabric
from transfer.plans import Op, OpKind, Plan
from transfer.regions import RegionMap

RegionCallback = Callable[[int], None]


@dataclass(frozen=True)
class ExecutorOptions:
    """Tuning knobs of one run."""

    window: int = 16  # outstanding ops per (peer, direction)


class _Edge:
    __slots__ = ("kind", "outstanding", "peer", "pending")

    def __init__(self, kind: OpKind, peer: Rank) -> None:
        self.kind = kind
        self.peer = peer
        self.pending: deque[int] = deque()
        self.outstanding = 0


class Executor:
    """One rank's run of one plan."""

    def __init__(
        self,
        fabric: Fabric,
        plan: Plan,
        buffer: str,
        regions: RegionMap,
        stream: int,
        deadline: Deadline,
        on_region: RegionCallback | None = None,
        options: ExecutorOptions | None = None,
    ) -> None:
        if regions.total != plan.total:
            raise ValueError(f"regions hold {regions.total} bytes but the plan moves {plan.total}")
        self.fabric, self.plan, self.buffer, self.regions = fabric, plan, buffer, regions
        self.stream, self.deadline = stream, deadline
        self.on_region = on_region
        self.window = (options or ExecutorOptions()).window
        self.ops = plan.for_rank(fabric.rank)
        self.done = [False] * len(self.ops)
        self.completions: queue.SimpleQueue[tuple[int, TransferError | None]] = queue.SimpleQueue()
        self.edges = self._edges()
        self.waiting_regions = self._region_counts()
        self.left = len(self.ops)

    def _edges(self) -> list[_Edge]:
        edges: dict[tuple[OpKind, Rank], _Edge] = {}
        for index, op in enumerate(self.ops):
            edge = edges.setdefault((op.kind, op.peer), _Edge(op.kind, op.peer))
            edge.pending.append(index)
        # receives first: posting them early lets senders stream without waiting
        return sorted(edges.values(), key=lambda e: e.kind is OpKind.SEND)

    def _region_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for op in self.ops:
            if op.kind is OpKind.RECV:
                for region in self.regions.touched(op.start, op.length):
                    counts[region] = counts.get(region, 0) + 1
        return counts

    def run(self) -> None:
        """Execute every op; raise the first `TransferError` (after aborting the plan's edges)."""
        try:
            self._connect_ahead()
            self._post_ready()
            while self.left:
                self._wait_one()
                self._post_ready()
        except TransferError as exc:
            self.abort(str(exc))
            raise

    def abort(self, reason: str) -> None:
        """Drop every connection of this plan on this stream (peers see `PeerGone`)."""
        for peer in self.plan.peers(self.fabric.rank):
            self.fabric.abort(peer, self.stream, reason)

    def _connect_ahead(self) -> None:
        # Connecting every outgoing edge first surfaces a layout mismatch or a missing peer at once
        # and lets the downstream rank's failures reach us; it costs nothing when already connected.
        for edge in self.edges:
            if edge.kind is OpKind.SEND:
                self._track(-1, self.fabric.connect(edge.peer, self.stream, self.deadline))
                self.left += 1

    def _track(self, index: int, handle: Handle) -> None:
        handle.add_done_callback(lambda h: self.completions.put((index, h.error)))

    def _wait_one(self) -> None:
        try:
            index, error = self.completions.get(timeout=max(self.deadline.remaining(), 0.001))
        except queue.Empty:
            left = self.left
            raise PeerTimeout(f"rank {self.fabric.rank}: {left} ops unfinished at the deadline") from None
        if error is not None:
            raise error
        self.left -= 1
        if index < 0:
            return
        self.done[index] = True
        op = self.ops[index]
        self._edge(op).outstanding -= 1
        if op.kind is OpKind.RECV:
            self._region_progress(op)

    def _edge(self, op: Op) -> _Edge:
        for edge in self.edges:
            if edge.kind is op.kind and edge.peer == op.peer:
                return edge
        raise KeyError(op)

    def _region_progress(self, op: Op) -> None:
        for region in self.regions.touched(op.start, op.length):
            self.waiting_regions[region] -= 1
            if self.waiting_regions[region] == 0 and self.on_region is not None:
                self.on_region(region)

    def _post_ready(self) -> None:
        for edge in self.edges:
            while edge.pending and edge.outstanding < self.window:
                op = self.ops[edge.pending[0]]
                if op.after is not None and not self.done[op.after]:
                    break
                self._post(edge, edge.pending.popleft(), op)

    def _post(self, edge: _Edge, index: int, op: Op) -> None:
        segments = self.regions.segments(op.start, op.length)
        post = self.fabric.send if op.kind is OpKind.SEND else self.fabric.recv
        handle = post(op.peer, self.buffer, segments, self.stream, self.deadline)
        edge.outstanding += 1
        self._track(index, handle)
