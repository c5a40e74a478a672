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

from transfer.core import Deadline, Rank, control_stream
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
    try:
        mine = Verdict.OK if ok else Verdict.FAILED
        if fabric.rank == ranks[0]:
            return _lead(fabric, ranks, name, records, tag, mine, deadline)
        return _follow(fabric, ranks[0], name, records, tag, mine, deadline)
    finally:
        fabric.unregister(name)


def _receive(
    fabric: Fabric, peer: Rank, name: str, records: bytearray, slot: int, tag: int, deadline: Deadline
) -> Verdict:
    """Receive `peer`'s record for `tag` into `slot`, skipping stale ones."""
    ctl = control_stream_of(name)
    while True:
        fabric.recv(peer, name, [(slot * RECORD.size, RECORD.size)], ctl, deadline).wait(deadline)
        got_tag, status = RECORD.unpack_from(records, slot * RECORD.size)
        if got_tag == tag:
            return Verdict(status) if status in (1, 2) else Verdict.FAILED


def control_stream_of(name: str) -> int:
    """The control stream encoded in a confirmation buffer name."""
    return control_stream(int(name.split(":")[1]))


def _follow(
    fabric: Fabric, leader: Rank, name: str, records: bytearray, tag: int, mine: Verdict, deadline: Deadline
) -> bool:
    ctl = control_stream_of(name)
    RECORD.pack_into(records, 0, tag, mine)
    try:
        # no wait on the send: a leader that already knows the collective failed does not read it
        fabric.send(leader, name, [(0, RECORD.size)], ctl, deadline)
        return _receive(fabric, leader, name, records, 1, tag, deadline) is Verdict.OK
    except TransferError as exc:
        fabric.abort(leader, ctl, str(exc))
        raise


def _lead(
    fabric: Fabric, ranks: Sequence[Rank], name: str, records: bytearray, tag: int, mine: Verdict,
    deadline: Deadline,
) -> bool:
    ctl = control_stream_of(name)
    verdict = mine
    for slot, rank in enumerate(ranks[1:], start=1):
        if verdict is Verdict.FAILED:
            break  # the verdict is known: tell everyone now (unread records are skipped later by tag)
        try:
            verdict = _receive(fabric, rank, name, records, slot, tag, deadline)
        except TransferError as exc:
            verdict = Verdict.FAILED  # a dead or stalled rank: the others must hear the collective failed
            fabric.abort(rank, ctl, str(exc))
    RECORD.pack_into(records, 0, tag, verdict)
    replies = [fabric.send(rank, name, [(0, RECORD.size)], ctl, deadline) for rank in ranks[1:]]
    if verdict is Verdict.OK:
        for reply in replies:
            reply.wait(deadline)
    # On failure the replies go out in the background: one may be stuck connecting to a dead rank
    # until the deadline, and nobody should wait for that.
    return verdict is Verdict.OK
