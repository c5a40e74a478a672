"""Moving one migration's KV over the fabric: header, one p2p run per layer, confirmation.

```
 sender                                            receiver
 send(header) ─────────────────────────────────►  read header (InboundTurns routes it to its Immigrate)
 for layer in range:  send_regions(layer) ═════►  for layer in range: recv_regions(layer)
 confirm(leader = sender) ◄──────────────────────► confirm: both learn whether both sides succeeded
```
The regions go in p2p runs of the transfer layer (gather on the sender, scatter on the receiver:
many small regions, few messages): one run over every layer when the sender has them all
(Migrate, MIGRATE), one run per layer when it produces them during a prefill (MIGRATE_PROGRESSIVE,
`header.streamed`). The receiver reads the header first and runs the same runs with the same
region lengths, so their messages match.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Sequence

from replica.cluster import KV_BUFFER
from replica.errors import FailedPrecondition, PeerTimeout, PeerUnavailable, ReplicaError
from replica.migration.plan import HEADER_BYTES, Header, Region
from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.confirm import confirm
from transfer.core import Deadline, Handle, Rank, Stream, control_stream
from transfer.errors import LayoutMismatch, PeerGone, TransferError
from transfer.errors import PeerTimeout as TransferTimeout
from transfer.fabric import Fabric

KV_STREAM = int(Stream.KV)
_OPTIONS = TransferOptions(confirm=False)  # one confirmation at the end of the whole migration
_names = itertools.count()


def as_replica_error(exc: TransferError) -> ReplicaError:
    """The replica error (and so the gRPC status) for a transfer failure."""
    if isinstance(exc, TransferTimeout):
        return PeerTimeout(f"KV migration: {exc}")
    if isinstance(exc, LayoutMismatch):
        return FailedPrecondition(f"KV migration: the peer's KV cache layout differs: {exc}")
    if isinstance(exc, PeerGone):
        return PeerUnavailable(f"KV migration: {exc}")
    return ReplicaError(f"KV migration: {type(exc).__name__}: {exc}")


def send_kv(
    fabric: Fabric, peer: int, header: Header, runs: Iterable[Sequence[Region]], deadline: Deadline
) -> None:
    """Send the header, then each run's regions as `runs` yields them, then confirm.

    Raises a `TransferError` (this side's, or `PeerGone` when the receiver reported a failure).
    Any other exception from `runs` (the prefill producing them failed) aborts the stream first,
    so the receiver fails at once instead of at its deadline.
    """
    name = f"__kv-header:{next(_names)}"
    fabric.register(name, bytearray(header.pack()))
    error: TransferError | None = None
    try:
        sent = fabric.send(peer, name, [(0, HEADER_BYTES)], KV_STREAM, deadline)
        for regions in runs:
            if regions:
                send_regions(fabric, peer, KV_BUFFER, regions, KV_STREAM, deadline, options=_OPTIONS)
        sent.wait(deadline)
    except TransferError as exc:
        error = exc
        fabric.abort(peer, KV_STREAM, str(exc))
    except BaseException as exc:
        fabric.abort(peer, KV_STREAM, f"the sender failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        fabric.unregister(name)
    _confirm(fabric, [fabric.rank, Rank(peer)], header.nonce, error, deadline)


def read_header(
    fabric: Fabric, peer: int, deadline: Deadline, cancelled: threading.Event | None = None
) -> Header:
    """Receive the next migration header from `peer` (the caller owns the stream).

    `cancelled` (the caller gave up) ends the wait: the stream is aborted, since nobody will read
    a header that arrives later.
    """
    name = f"__kv-header:{next(_names)}"
    buffer = bytearray(HEADER_BYTES)
    fabric.register(name, buffer)
    try:
        # connect the confirmation stream early: the sender then sees our death while it sends
        fabric.connect(peer, control_stream(KV_STREAM), deadline)
        handle = fabric.recv(peer, name, [(0, HEADER_BYTES)], KV_STREAM, deadline)
        if cancelled is not None:
            _wait_or_cancel(fabric, peer, handle, deadline, cancelled)
        handle.wait(deadline)
    finally:
        fabric.unregister(name)
    try:
        return Header.unpack(buffer)
    except ValueError as exc:
        fabric.abort(peer, KV_STREAM, str(exc))
        raise PeerGone(f"rank {peer} sent a malformed migration header: {exc}") from exc


def _wait_or_cancel(
    fabric: Fabric, peer: int, handle: Handle, deadline: Deadline, cancelled: threading.Event
) -> None:
    done = threading.Event()
    handle.add_done_callback(lambda _: done.set())
    while not done.wait(min(deadline.remaining(), 0.2)) and not deadline.expired():
        if cancelled.is_set():
            fabric.abort(peer, KV_STREAM, "the receiver's caller cancelled")
            return  # the handle has failed: its wait raises


def recv_kv(
    fabric: Fabric, peer: int, header: Header, runs: Sequence[Sequence[Region]], deadline: Deadline
) -> None:
    """Receive each run's regions (the header was read already), then confirm."""
    error: TransferError | None = None
    try:
        for regions in runs:
            if regions:
                recv_regions(fabric, peer, KV_BUFFER, regions, KV_STREAM, deadline, options=_OPTIONS)
    except TransferError as exc:
        error = exc
        fabric.abort(peer, KV_STREAM, str(exc))
    _confirm(fabric, [Rank(peer), fabric.rank], header.nonce, error, deadline)


def refuse(fabric: Fabric, peer: int, header: Header, reason: str, deadline: Deadline) -> None:
    """Tell the sender this migration failed here (its confirmation fails), without reading its data."""
    fabric.abort(peer, KV_STREAM, reason)
    with contextlib.suppress(TransferError):  # the error that matters is the caller's
        _confirm(fabric, [Rank(peer), fabric.rank], header.nonce, PeerGone(reason), deadline)


def _confirm(
    fabric: Fabric, ranks: list[Rank], tag: int, error: TransferError | None, deadline: Deadline
) -> None:
    """Both sides learn whether both succeeded; raise this side's error or the peer's failure.

    A side that failed does not wait for the verdict: it tells the leader in the background (the
    leader may be dead, and connecting to a dead rank retries until the deadline) and fails now.
    """
    if error is not None:
        if fabric.rank != ranks[0]:
            threading.Thread(target=_report_failure, args=(fabric, ranks, tag, deadline), daemon=True).start()
            raise error
        with contextlib.suppress(TransferError):
            confirm(fabric, ranks, KV_STREAM, tag, False, deadline)  # the leader does not wait on failure
        raise error
    if deadline.expired():
        raise TransferTimeout(f"rank {fabric.rank}: migration deadline passed")
    if not confirm(fabric, ranks, KV_STREAM, tag, True, deadline):
        raise PeerGone(f"rank {fabric.rank}: the other side of the migration {list(ranks)} failed")


def _report_failure(fabric: Fabric, ranks: list[Rank], tag: int, deadline: Deadline) -> None:
    with contextlib.suppress(Exception):  # best effort: the peer learns of the failure by its own deadline
        confirm(fabric, ranks, KV_STREAM, tag, False, deadline)
