"""Moving one migration's KV over the fabric: header, one p2p run per layer, acknowledgement.

```
 sender                                            receiver
 send(header) ─────────────────────────────────►  read header (InboundTurns routes it to its Immigrate)
 wait for the have ◄─ KV_HAVE: (nonce, OK, skips)─  the leading pages it holds (or FAILED: refused)
 for layer in range:  send_regions(layer) ═════►  for layer in range: recv_regions(layer)
                      (each request's first `skip` pages left out, on both sides)
 wait for the ack  ◄───── (nonce, OK | FAILED) ──  every byte in place (or failed): ack, done
```
The have is one round trip before the first KV byte: a prefill streaming its layers
(MIGRATE_PROGRESSIVE) overlaps it with its first layer. It travels on its own stream (`KV_HAVE`)
as a fixed record and a counts message (`plan.Have`), so a stale one of an earlier attempt is
skipped by its nonce whatever its size.
The acknowledgement is one record on the KV stream's control stream, in the format of
`transfer.confirm` (`tag u64 | status u8`, the tag being the header's nonce). It replaces the
transfer layer's two-way confirmation (record to the leader, verdict back): the receiver's outcome
is settled once its bytes are in (nothing the sender could still say would change it), and a
sender that fails aborts the KV stream, which fails the receiver's reads at once.
The regions go in p2p runs of the transfer layer (gather on the sender, scatter on the receiver:
many small regions, few messages): one run over every layer when the sender has them all
(Migrate, MIGRATE), one run per layer when it produces them during a prefill (MIGRATE_PROGRESSIVE,
`header.streamed`). The receiver reads the header first and runs the same runs with the same
region lengths, so their messages match.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterable, Sequence

from replica.cluster import KV_BUFFER
from replica.errors import FailedPrecondition, PeerTimeout, PeerUnavailable, ReplicaError
from replica.migration.plan import HAVE_BYTES, HEADER_BYTES, Have, Header, Region
from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.confirm import RECORD, Verdict
from transfer.core import Deadline, Handle, Stream, control_stream
from transfer.errors import LayoutMismatch, PeerGone, TransferError
from transfer.errors import PeerTimeout as TransferTimeout
from transfer.fabric import Fabric

KV_STREAM = int(Stream.KV)
HAVE_STREAM = int(Stream.KV_HAVE)
Runs = Callable[[Sequence[int]], Iterable[Sequence[Region]]]
"""The sender's runs of regions, given the receiver's skipped pages per request."""
_OPTIONS = TransferOptions(confirm=False)  # one acknowledgement at the end of the whole migration
# Both replicas were serving when the router paired them, so the receiver's fabric listens: one that
# still does not take the KV connection after this long is gone, and the sender fails UNAVAILABLE now
# instead of retrying until the migration's deadline (minutes, with the router's prefill loop held).
CONNECT_GRACE_S = 10.0
_LATE_ACK_S = 2.0  # an acknowledgement may go out this long past the receiver's deadline
_names = itertools.count()


def as_replica_error(exc: TransferError) -> ReplicaError:
    """The replica error (and so the gRPC status) for a transfer failure."""
    if isinstance(exc, TransferTimeout):
        return PeerTimeout(f"KV migration: {exc}")
    if isinstance(exc, LayoutMismatch):
        sizes = sorted(set(re.findall(r'"tp_size":(\d+)', str(exc))), key=int)
        differ = f" (tensor-parallel sizes differ: tp {' vs tp '.join(sizes)})" if len(sizes) > 1 else ""
        return FailedPrecondition(f"KV migration: the peer's KV cache layout differs{differ}: {exc}")
    if isinstance(exc, PeerGone):
        return PeerUnavailable(f"KV migration: {exc}")
    return ReplicaError(f"KV migration: {type(exc).__name__}: {exc}")


def send_kv(fabric: Fabric, peer: int, header: Header, runs: Runs, deadline: Deadline) -> tuple[int, ...]:
    """Send the header, read the receiver's have, then each run's regions as `runs(skips)` yields
    them, then wait for the ack; returns the skipped pages per request.

    Raises a `TransferError` (this side's, or `PeerGone` when the receiver refused or reported a
    failure). Any other exception from `runs` (the prefill producing them failed) aborts the stream
    first, so the receiver fails at once instead of at its deadline.
    """
    name = f"__kv-header:{next(_names)}"
    fabric.register(name, bytearray(header.pack()))
    error: TransferError | None = None
    skips: tuple[int, ...] = ()
    # a new migration: a connection the receiver reset for an earlier one (it aborted, or restarted)
    # is replaced now rather than failing this header
    fabric.refresh(peer, KV_STREAM)
    try:
        _connect(fabric, peer, deadline)
        sent = fabric.send(peer, name, [(0, HEADER_BYTES)], KV_STREAM, deadline)
        skips = _await_have(fabric, peer, header, deadline)
        for regions in runs(skips):
            if regions:
                send_regions(fabric, peer, KV_BUFFER, regions, KV_STREAM, deadline, options=_OPTIONS)
        sent.wait(deadline)
    except TransferError as exc:
        error = exc
        _abort_data(fabric, peer, str(exc))
    except BaseException as exc:
        _abort_data(fabric, peer, f"the sender failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        fabric.unregister(name)
    _await_ack(fabric, peer, header.nonce, error, deadline)
    return skips


def _abort_data(fabric: Fabric, peer: int, reason: str) -> None:
    """(Sender) drop the KV stream and the have stream (an unread have would be stale next time)."""
    fabric.abort(peer, KV_STREAM, reason)
    fabric.abort(peer, HAVE_STREAM, reason)


def _await_have(fabric: Fabric, peer: int, header: Header, deadline: Deadline) -> tuple[int, ...]:
    """(Sender) the receiver's skipped pages per request; `PeerGone` if it refused the migration.
    Answers to earlier attempts (another nonce) are read and skipped."""
    while True:
        nonce, ok, num_seqs = Have.unpack_record(_read(fabric, peer, HAVE_BYTES, deadline))
        counts = _read(fabric, peer, Have.counts_bytes(num_seqs), deadline) if num_seqs else b""
        if nonce != header.nonce:
            continue
        if not ok:
            raise PeerGone(f"rank {fabric.rank}: the receiver of the migration, rank {peer}, refused it")
        if num_seqs != header.num_seqs:
            raise PeerGone(f"rank {peer} answered for {num_seqs} requests, the batch has {header.num_seqs}")
        return Have.unpack_counts(counts, num_seqs)


def _read(fabric: Fabric, peer: int, nbytes: int, deadline: Deadline) -> bytearray:
    """One message of `nbytes` from `peer` on the have stream."""
    name = f"__kv-have:{next(_names)}"
    buffer = bytearray(nbytes)
    fabric.register(name, buffer)
    try:
        fabric.recv(peer, name, [(0, nbytes)], HAVE_STREAM, deadline).wait(deadline)
    finally:
        fabric.unregister(name)
    return buffer


def abort_sender(fabric: Fabric, peer: int, reason: str) -> None:
    """Fail a sender's every wait on `peer` at once: its KV stream and the stream of its ack."""
    fabric.abort(peer, KV_STREAM, reason)
    fabric.abort(peer, HAVE_STREAM, reason)
    fabric.abort(peer, control_stream(KV_STREAM), reason)


def _connect(fabric: Fabric, peer: int, deadline: Deadline) -> None:
    """The KV connection to `peer` (at once when it is up), within `CONNECT_GRACE_S`: past that the
    receiver is gone (`PeerGone`), unless the migration's own deadline came first (`TransferTimeout`)."""
    grace = Deadline.after(min(deadline.remaining(), CONNECT_GRACE_S))
    try:
        fabric.connect(peer, KV_STREAM, grace).wait(grace)
    except TransferTimeout as exc:
        if deadline.expired():
            raise
        raise PeerGone(
            f"rank {peer} did not take the KV connection within {CONNECT_GRACE_S:g} s (gone?): {exc}"
        ) from exc


def read_header(
    fabric: Fabric, peer: int, deadline: Deadline, cancelled: threading.Event | None = None
) -> Header:
    """Receive the next migration header from `peer` (the caller owns the stream).

    At the deadline, or once `cancelled` is set (the caller gave up), the receive is withdrawn and
    the stream left as it is, so the pair's next migration finds it intact (a header that comes
    later goes to the next reader, who refuses it: see `InboundTurns`). Only when the header is
    arriving at that very moment is the stream aborted instead.
    """
    name = f"__kv-header:{next(_names)}"
    buffer = bytearray(HEADER_BYTES)
    fabric.register(name, buffer)
    try:
        # connect the acknowledgement stream early: the sender then sees our death while it sends.
        # A connection to the sender's previous life (it died and restarted with its rank) is dropped
        # first: a record written into it is lost without an error, and the sender would wait for its
        # ack until the deadline.
        for stream in (control_stream(KV_STREAM), HAVE_STREAM):
            fabric.refresh(peer, stream)
            fabric.connect(peer, stream, deadline)
        handle = fabric.recv(peer, name, [(0, HEADER_BYTES)], KV_STREAM, deadline)
        _await_or_withdraw(fabric, peer, handle, deadline, cancelled)
    finally:
        fabric.unregister(name)
    try:
        return Header.unpack(buffer)
    except ValueError as exc:
        fabric.abort(peer, KV_STREAM, str(exc))
        raise PeerGone(f"rank {peer} sent a malformed migration header: {exc}") from exc


def _await_or_withdraw(
    fabric: Fabric, peer: int, handle: Handle, deadline: Deadline, cancelled: threading.Event | None
) -> None:
    """Wait for the header receive; on giving up take it back (else abort the stream); raise its error."""
    done = threading.Event()
    handle.add_done_callback(lambda _: done.set())
    while not done.wait(min(deadline.remaining(), 0.2)):
        gave_up = cancelled is not None and cancelled.is_set()
        if gave_up or deadline.expired():
            where = f"rank {fabric.rank}: no migration header from rank {peer}"
            error: TransferError = PeerGone(f"{where}: the caller cancelled")
            if not gave_up:
                error = TransferTimeout(f"{where} in time")
            if not fabric.withdraw(peer, KV_STREAM, handle, error) and not handle.done():
                fabric.abort(peer, KV_STREAM, str(error))  # being filled: the stream cannot be kept
            break
    handle.wait(Deadline(0.0))  # done: returns or raises its error; still running: aborts, times out


def recv_kv(
    fabric: Fabric,
    peer: int,
    header: Header,
    skips: Sequence[int],
    runs: Sequence[Sequence[Region]],
    deadline: Deadline,
) -> None:
    """Tell the sender the pages to skip (`skips`, per request), receive each run's regions (the
    header was read already; `runs` leave the skipped pages out), then acknowledge; a failure here
    is reported to the sender, then raised."""
    error: TransferError | None = None
    _post_have(fabric, peer, Have(header.nonce, True, tuple(skips)), deadline)
    try:
        for regions in runs:
            if regions:
                recv_regions(fabric, peer, KV_BUFFER, regions, KV_STREAM, deadline, options=_OPTIONS)
    except TransferError as exc:
        error = exc
        fabric.abort(peer, KV_STREAM, str(exc))
    _ack(fabric, peer, header.nonce, error is None, deadline)
    if error is not None:
        raise error


def refuse(fabric: Fabric, peer: int, header: Header, reason: str, deadline: Deadline) -> None:
    """Tell the sender this migration failed here (a FAILED have: it sends nothing), without reading
    its data."""
    fabric.abort(peer, KV_STREAM, reason)
    _post_have(fabric, peer, Have(header.nonce, False, (0,) * header.num_seqs), deadline)


def _post_have(fabric: Fabric, peer: int, have: Have, deadline: Deadline) -> None:
    """(Receiver) send the have's two messages, not waiting for them to go out (as `_ack`)."""
    _post(fabric, peer, [bytearray(part) for part in have.pack() if part], HAVE_STREAM, deadline)


def _await_ack(fabric: Fabric, peer: int, tag: int, error: TransferError | None, deadline: Deadline) -> None:
    """(Sender) the receiver's acknowledgement that every byte is in place; raise this side's error
    or the receiver's failure.

    A sender that failed has aborted the KV stream already (the receiver's reads fail at once), so
    it does not wait for anything; one that fails here aborts it too. Records of earlier, failed
    migrations (another nonce) are skipped.
    """
    if error is not None:
        raise error
    ctl = control_stream(KV_STREAM)
    name = f"__kv-ack:{next(_names)}"
    record = bytearray(RECORD.size)
    fabric.register(name, record)
    try:
        while True:
            fabric.recv(peer, name, [(0, RECORD.size)], ctl, deadline).wait(deadline)
            got, status = RECORD.unpack(record)
            if got == tag:
                break
    except TransferError as exc:
        fabric.abort(peer, ctl, str(exc))
        fabric.abort(peer, KV_STREAM, str(exc))
        raise
    finally:
        fabric.unregister(name)
    if status != Verdict.OK:
        # the receiver reset its end of the KV stream: drop ours too, so the next migration to
        # this peer connects afresh instead of writing into the dead connection
        reason = f"rank {fabric.rank}: the receiver of the migration, rank {peer}, failed"
        fabric.abort(peer, KV_STREAM, reason)
        raise PeerGone(reason)


def _ack(fabric: Fabric, peer: int, tag: int, ok: bool, deadline: Deadline) -> None:
    """(Receiver) tell the sender whether every byte arrived here; not waiting for it to go out.

    The receiver's own outcome is decided (it has every byte, or it failed), so nothing it could
    hear back would change it: no verdict round trip.
    """
    record = bytearray(RECORD.pack(tag, Verdict.OK if ok else Verdict.FAILED))
    _post(fabric, peer, [record], control_stream(KV_STREAM), deadline)


def _post(fabric: Fabric, peer: int, messages: Sequence[bytearray], stream: int, deadline: Deadline) -> None:
    """Send small messages to `peer` on `stream`, one after the other, without waiting for them.

    Each is written by this thread when the connection is idle, else by the fabric's writer, and the
    next is posted once it went out. Over a connection the sender reset in an earlier failed attempt
    the first write fails, and the message is sent once more over a fresh connection (its nonce
    makes it unambiguous). They get at least `_LATE_ACK_S` to go out, even past this side's deadline
    (which may be why it failed).
    """
    name = f"__kv-post:{next(_names)}"
    late = Deadline.after(max(deadline.remaining(), _LATE_ACK_S))

    def post(index: int, retry: bool) -> None:
        if index == len(messages):
            return
        fabric.register(name, messages[index])
        try:
            handle = fabric.send(peer, name, [(0, len(messages[index]))], stream, late)
        except TransferError:  # the fabric is closing: the sender learns by its own deadline
            fabric.unregister(name)
            return
        handle.add_done_callback(lambda h: done(h, index, retry))

    def done(handle: Handle, index: int, retry: bool) -> None:
        fabric.unregister(name)
        if retry and isinstance(handle.error, PeerGone):
            post(index, False)
        elif handle.error is None:
            post(index + 1, True)

    post(0, True)
