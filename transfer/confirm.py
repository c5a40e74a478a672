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
from transfer.errors import TransferError
from transfer.fabric import Fabric

RECORD = struct.Struct("!QB")
_names = itertools.count()


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

    def send(self, peer: Rank, verdict: Verdict) -> Handle:
        """Send `verdict` (from slot 0) to `peer`."""
        RECORD.pack_into(self.records, 0, self.tag, verdict)
        return self.fabric.send(peer, self.name, [(0, RECORD.size)], self.ctl, self.deadline)


def _follow(exchange: _Exchange, leader: Rank, mine: Verdict) -> bool:
    try:
        # no wait on the send: a leader that already knows the collective failed does not read it
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
    replies = [exchange.send(rank, verdict) for rank in ranks[1:]]
    if verdict is Verdict.OK:
        for reply in replies:
            reply.wait(exchange.deadline)
    # On failure the replies go out in the background: one may be stuck connecting to a dead rank
    # until the deadline, and nobody should wait for that.
    return verdict is Verdict.OK
