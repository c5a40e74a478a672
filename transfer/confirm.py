"""The end-of-collective confirmation: every rank tells the leader how it did; the leader answers.

Without it, a sender whose bytes sit in kernel buffers would report success although a receiver
died. Records are `tag u64 | status u8` on the control stream of the data stream. The tag (caller
chosen, e.g. a migration id or attempt number) lets a rank discard a stale record left by an
earlier failed attempt; retries should use a new tag.
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.core import Deadline, Handle, Rank, control_stream
from transfer.errors import PeerGone, TransferError
from transfer.fabric import Fabric

RECORD = struct.Struct("!QB")
_names = itertools.count()
# A failure verdict goes out in the background even when the leader's own deadline has passed (that
# may be why it failed); it gets this long to connect and be written, so that its connection is not
# cut mid-handshake by an expired deadline (which the peer would see as losing the connection).
_LATE_VERDICT_S = 2.0


class Verdict(enum.IntEnum):
    """A rank's (or the collective's) outcome."""

    OK = 1
    FAILED = 2


def confirm(
    fabric: Fabric, ranks: Sequence[Rank], stream: int, tag: int, ok: bool, deadline: Deadline
) -> bool:
    """Gather every rank's status at `ranks[0]`; return the collective's verdict (True: all succeeded)."""
    name = f"__confirm:{stream}:{next(_names)}"
    records = bytearray(RECORD.size * (len(ranks) + 1))
    fabric.register(name, records)
    exchange = _Exchange(fabric, name, records, control_stream(stream), tag, deadline)
    try:
        mine = Verdict.OK if ok else Verdict.FAILED
        if fabric.rank == ranks[0]:
            return _lead(exchange, ranks, mine)
        return _follow(exchange, ranks[0], mine)
    finally:
        fabric.unregister(name)


@dataclass(frozen=True)
class _Exchange:
    """One confirmation round: where the records live and where they travel."""

    fabric: Fabric
    name: str
    records: bytearray
    ctl: int
    tag: int
    deadline: Deadline

    def receive(self, peer: Rank, slot: int) -> Verdict:
        """Receive `peer`'s record for this tag into `slot`, skipping stale ones."""
        while True:
            segment = [(slot * RECORD.size, RECORD.size)]
            self.fabric.recv(peer, self.name, segment, self.ctl, self.deadline).wait(self.deadline)
            got_tag, status = RECORD.unpack_from(self.records, slot * RECORD.size)
            if got_tag == self.tag:
                return Verdict(status) if status in (1, 2) else Verdict.FAILED

    def send(self, peer: Rank, verdict: Verdict, deadline: Deadline | None = None) -> Handle:
        """Send `verdict` (from slot 0) to `peer` (by `deadline`, default the exchange's)."""
        RECORD.pack_into(self.records, 0, self.tag, verdict)
        return self.fabric.send(peer, self.name, [(0, RECORD.size)], self.ctl, deadline or self.deadline)

    def deliver(self, peer: Rank, verdict: Verdict) -> None:
        """Send `verdict` to `peer` and wait until it is out, over a fresh connection if need be.

        The control connection may still be one that `peer` closed when an earlier attempt failed
        there (its abort resets the pair; this side learns of it only on the next write). Records
        carry their tag, so resending over the new connection cannot be mistaken for anything else.
        """
        try:
            self.send(peer, verdict).wait(self.deadline)
        except PeerGone:
            self.send(peer, verdict).wait(self.deadline)


def _follow(exchange: _Exchange, leader: Rank, mine: Verdict) -> bool:
    try:
        # no wait on the send: a leader that already knows the collective failed does not read it
        # (and on a rendezvous fabric such as NCCL a send completes only once it is read)
        exchange.send(leader, mine)
        return exchange.receive(leader, 1) is Verdict.OK
    except TransferError as exc:
        exchange.fabric.abort(leader, exchange.ctl, str(exc))
        raise


def _lead(exchange: _Exchange, ranks: Sequence[Rank], mine: Verdict) -> bool:
    verdict = mine
    for slot, rank in enumerate(ranks[1:], start=1):
        if verdict is Verdict.FAILED:
            break  # the verdict is known: tell everyone now (unread records are skipped later by tag)
        try:
            verdict = exchange.receive(rank, slot)
        except TransferError as exc:
            verdict = Verdict.FAILED  # a dead or stalled rank: the others must hear the collective failed
            exchange.fabric.abort(rank, exchange.ctl, str(exc))
    if verdict is Verdict.OK:
        for rank in ranks[1:]:
            exchange.deliver(rank, verdict)
        return True
    # On failure the replies go out in the background: one may be stuck connecting to a dead rank
    # until the deadline, and nobody should wait for that.
    late = Deadline.after(max(exchange.deadline.remaining(), _LATE_VERDICT_S))
    for rank in ranks[1:]:
        exchange.send(rank, verdict, late)
    return False
