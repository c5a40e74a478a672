"""`connect_peers`: this replica's fabric connections with peers, set up before any transfer needs them.

```
 router: a replica joins ──► ConnectPeers(peers=[every other replica's rank]) on it
                        └──► ConnectPeers(peers=[its rank]) on every other replica   (both ends: NCCL pairs)
 replica: for each peer × WARM_STREAMS ─► fabric.warm(peer, stream, deadline)  (no message moves)
```
A scale-up's first transfer (weights into an inactive replica, KV into a new decode replica) then
finds its connections up instead of making them on its critical path: a TCP handshake with the
layout check, or two NCCL communicators per edge. A peer that cannot be reached by the deadline is
reported in its `PeerLink`, never raised: the call succeeds, the transfer that needs it later
connects (or fails) as it would have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from replica.errors import InvalidArgument
from transfer.core import Deadline, Stream, control_stream
from transfer.errors import TransferError
from transfer.fabric import Fabric
from transfer.ranktable import RankTable

WARM_STREAMS: tuple[int, ...] = (
    Stream.KV, control_stream(Stream.KV), Stream.PARAMS, control_stream(Stream.PARAMS), Stream.ACTIVATION,
)
"""The streams KV (and its acknowledgements), weights (and their confirmations) and activations use."""


class PeerLink(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One peer's connections: `error` empty when every stream's is up; `connect_ms` until then."""

    rank: int
    error: str
    connect_ms: float


def connect_peers(fabric: Fabric, table: RankTable, me: int, peers: Sequence[int],
                  deadline: Deadline) -> tuple[PeerLink, ...]:
    """Warm every stream of `WARM_STREAMS` with each of `peers` at once; one `PeerLink` per peer, in
    order. `InvalidArgument` (nothing started) for this replica's own rank or one the table lacks."""
    wrong = [p for p in peers if p == me or p not in table.ranks]
    if wrong:
        raise InvalidArgument(f"ConnectPeers: ranks {wrong} are this replica ({me}) or not in the rank table "
                              f"(ranks {list(table.ranks)})")
    start = time.monotonic()
    posted = [(peer, [(stream, fabric.warm(peer, stream, deadline)) for stream in WARM_STREAMS])
              for peer in dict.fromkeys(peers)]
    links: dict[int, PeerLink] = {}
    for peer, handles in posted:
        error = ""
        for stream, handle in handles:
            try:
                handle.wait(deadline)
            except TransferError as exc:
                error = error or f"stream {stream}: {type(exc).__name__}: {exc}"
        links[peer] = PeerLink(peer, error, (time.monotonic() - start) * 1e3)
    return tuple(links[p] for p in peers)
