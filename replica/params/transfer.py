"""`WeightMover`: this replica's part in moving the whole weight buffer to or from peers.

Every operation moves the buffer region by region (`embed | layer 0 | … | head`, each at its own
offset) on the PARAMS stream through `transfer.collectives`, which tells us as each region is
completely in place; a receiver then marks that region ready, so layer i becomes usable while
layer i+1 is still on the wire. Who plays which part is derived from the rank lists and this rank.

```
 p2p     send_to(dst) ───────────────────────────────► recv_from(src)
 host    send_host_copy(dst): a host-memory copy ────► recv_from(src)   (the buffer untouched)
 shares  send_to / send_host_copy(share i of n) × n ─► recv_from_many([src0, …]) (shares.py split)
 chain   [head] ─► r1 ─► r2 ─► … (store-and-forward per chunk)         RdmaBroadcast / NvlBroadcast
 Tanz    s sources, lanes of |dst|/s receivers get stripes, then rings all-gather them   TanzBroadcast
```
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from replica.cancellation import aborting
from replica.errors import (
    FailedPrecondition,
    InvalidArgument,
    PeerTimeout,
    PeerUnavailable,
    ReplicaError,
)
from replica.params.shares import share_of
from replica.params.store import ParamStore
from transfer.collectives import (
    TransferOptions,
    chain_broadcast,
    recv_regions,
    send_regions,
    tanz_broadcast,
)
from transfer.core import Deadline, Stream, control_stream
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone, TransferError
from transfer.errors import PeerTimeout as TransferTimeout
from transfer.fabric import Fabric

log = logging.getLogger(__name__)

HOST_COPY_BUFFER = "weights-host"  # the fabric name of a host copy while it is being sent


def replica_error(exc: TransferError, what: str) -> ReplicaError:
    """The replica error (and so the gRPC status) a transfer failure maps to."""
    message = f"{what}: {exc}"
    if isinstance(exc, TransferTimeout):
        return PeerTimeout(message)
    if isinstance(exc, PeerGone | FabricClosed):
        return PeerUnavailable(message)
    if isinstance(exc, LayoutMismatch):
        return FailedPrecondition(message)
    return ReplicaError(message)


def chain_of(src: Sequence[int], dst: Sequence[int], tp_rank: int = 0) -> list[int]:
    """The chain of one tensor-parallel rank: `[src[t]] + dst[t::tp]` (tp = |src|)."""
    tp = len(src)
    if tp == 0 or not dst or len(dst) % tp:
        raise InvalidArgument(f"broadcast needs sources and a multiple of {tp or 1} destinations")
    return [src[tp_rank], *dst[tp_rank::tp]]


class WeightMover:
    """Moves `store`'s buffer (registered on `fabric` as `buffer_name`) to or from peers."""

    def __init__(
        self, fabric: Fabric, store: ParamStore, buffer_name: str, options: TransferOptions | None = None
    ) -> None:
        self.fabric = fabric
        self.store = store
        self.buffer_name = buffer_name
        self.options = options or TransferOptions()

    @property
    def rank(self) -> int:
        """This replica's global rank."""
        return int(self.fabric.rank)

    def _check_peer(self, peer: int) -> None:
        if peer == self.rank or peer not in self.fabric.table:
            raise InvalidArgument(f"rank {peer} is not a peer of rank {self.rank} in the rank table")

    def prepare_send(self, peer: int, model: str = "") -> None:
        """Checks before a background send (so the RPC can refuse at once); `model`: what the caller
        asks to send (a buffer holding another model refuses)."""
        self._check_peer(peer)
        self.store.require_complete(f"sending weights to rank {peer}")
        self.store.require_model(f"sending weights to rank {peer}", model)

    def prepare_send_host(self, peer: int, model: str) -> None:
        """Checks before a background send of the host copy of `model` (NOT_FOUND: none held), which
        is registered on the fabric for the send (a fabric that cannot move host memory refuses)."""
        self._check_peer(peer)
        copy = self.store.host_copy_to_send(model)
        try:
            self.fabric.register(HOST_COPY_BUFFER, copy)
        except ValueError as exc:
            raise FailedPrecondition(f"this fabric cannot send host memory: {exc}") from exc

    def send_host_copy(self, peer: int, model: str, deadline: Deadline,
                       cancelled: threading.Event | None = None, share: tuple[int, int] = (0, 0)) -> None:
        """Send the host copy of `model` (or share `share[0]` of `share[1]` of it) to `peer` region by
        region (after `prepare_send_host`); the receiver runs `recv_from` (`recv_from_many`), so its
        layers become usable as they land."""
        _, regions = self.share(*share)
        try:
            self._run(
                lambda: send_regions(self.fabric, peer, HOST_COPY_BUFFER, regions,
                                     Stream.PARAMS, deadline, options=self.options),
                f"sending the host copy of {model} to rank {peer}",
                [peer],
                cancelled,
            )
        finally:
            self.fabric.unregister(HOST_COPY_BUFFER)

    def prepare_recv(self, peer: int, model: str = "") -> None:
        """Checks and readiness reset before a background receive of `model` (recorded as the
        buffer's model; "": unknown)."""
        self._check_peer(peer)
        self.store.begin_receive(f"receiving weights from rank {peer}", model)

    def share(self, share: int = 0, shares: int = 0) -> tuple[int, list[tuple[int, int]]]:
        """(first region index, (offset, length) of each region) of share `share` of `shares`
        (`shares.py`; 0 shares: every region)."""
        regions = self.store.regions()
        if shares <= 1 and share == 0:
            return 0, regions
        begin, end = share_of([n for _, n in regions], share, shares)
        return begin, regions[begin:end]

    def send_to(self, peer: int, deadline: Deadline, cancelled: threading.Event | None = None,
                share: tuple[int, int] = (0, 0)) -> None:
        """p2p: send every region (or share `share[0]` of `share[1]`) to `peer` (after
        `prepare_send`); `cancelled` aborts it at once."""
        _, regions = self.share(*share)
        self._run(
            lambda: send_regions(
                self.fabric,
                peer,
                self.buffer_name,
                regions,
                Stream.PARAMS,
                deadline,
                options=self.options,
            ),
            f"sending weights to rank {peer}",
            [peer],
            cancelled,
        )

    def recv_from(self, peer: int, deadline: Deadline, cancelled: threading.Event | None = None) -> None:
        """p2p: receive every region from `peer`, marking each ready as it lands (after `prepare_recv`);
        `cancelled` aborts it at once."""
        self._run(
            lambda: recv_regions(
                self.fabric,
                peer,
                self.buffer_name,
                self.store.regions(),
                Stream.PARAMS,
                deadline,
                self.store.mark_region,
                self.options,
            ),
            f"receiving weights from rank {peer}",
            [peer],
            cancelled,
        )

    def recv_from_many(self, peers: Sequence[int], deadline: Deadline,
                       cancelled: threading.Event | None = None) -> None:
        """Receive share i of the regions from `peers[i]`, all at once, marking each region ready as it
        lands (after `prepare_recv` of every peer); the first failure aborts the others."""
        parts = [self.share(i, len(peers)) for i in range(len(peers))]

        def receive(peer: int, base: int, regions: list[tuple[int, int]]) -> None:
            recv_regions(self.fabric, peer, self.buffer_name, regions, Stream.PARAMS, deadline,
                         lambda i: self.store.mark_region(base + i), self.options)

        def all_shares() -> None:
            with ThreadPoolExecutor(len(peers), thread_name_prefix="params-share") as pool:
                futures = [pool.submit(receive, p, b, r) for p, (b, r) in zip(peers, parts, strict=True)]
                try:
                    for future in futures:
                        future.result()
                except BaseException:
                    self._abort(peers, "another share of the weights failed")
                    raise

        self._run(all_shares, f"receiving weights from ranks {list(peers)}", peers, cancelled)

    def prepare_chain(self, chain: Sequence[int], model: str = "") -> None:
        """Checks (and, on a receiver, readiness reset and `model` recorded) before a chain multicast."""
        if self.rank not in chain:
            raise InvalidArgument(f"rank {self.rank} is not in the chain {list(chain)}")
        if len(set(chain)) != len(chain):
            raise InvalidArgument(f"the chain {list(chain)} names a rank twice")
        for peer in chain:
            if peer != self.rank:
                self._check_peer(peer)
        if chain[0] == self.rank:
            self.store.require_complete("heading a weight multicast")
            self.store.require_model("heading a weight multicast", model)
        else:
            self.store.begin_receive("receiving a weight multicast", model)

    def chain(
        self, chain: Sequence[int], deadline: Deadline, cancelled: threading.Event | None = None
    ) -> None:
        """Chain multicast from `chain[0]`; receivers mark regions as they land; `cancelled` (the
        caller gave up) aborts it at once."""
        on_region = None if chain[0] == self.rank else self.store.mark_region
        self._run(
            lambda: chain_broadcast(
                self.fabric,
                chain,
                self.buffer_name,
                self.store.regions(),
                Stream.PARAMS,
                deadline,
                on_region,
                self.options,
            ),
            f"weight multicast along {list(chain)}",
            chain,
            cancelled,
        )

    def prepare_tanz(self, sources: Sequence[int], dests: Sequence[int], model: str = "") -> None:
        """Checks (and, on a receiver, readiness reset and `model` recorded) before a Tanz broadcast."""
        if not sources or not dests or len(dests) % len(sources):
            raise InvalidArgument(
                f"Tanz needs sources and a multiple of {len(sources) or 1} destinations, "
                f"got {len(sources)} and {len(dests)}"
            )
        members = [*sources, *dests]
        if len(set(members)) != len(members):
            raise InvalidArgument(f"Tanz ranks {members} name a rank twice")
        if self.rank not in members:
            raise InvalidArgument(f"rank {self.rank} is not in the Tanz broadcast {members}")
        for peer in members:
            if peer != self.rank:
                self._check_peer(peer)
        if self.rank in sources:
            self.store.require_complete("sourcing a Tanz broadcast")
            self.store.require_model("sourcing a Tanz broadcast", model)
        else:
            self.store.begin_receive("receiving a Tanz broadcast", model)

    def tanz(
        self,
        sources: Sequence[int],
        dests: Sequence[int],
        deadline: Deadline,
        cancelled: threading.Event | None = None,
    ) -> None:
        """Tanz: sources feed stripes down lanes of receivers, which then ring-exchange them;
        `cancelled` (the caller gave up) aborts it at once."""
        on_region = None if self.rank in sources else self.store.mark_region
        self._run(
            lambda: tanz_broadcast(
                self.fabric,
                sources,
                dests,
                self.buffer_name,
                self.store.regions(),
                Stream.PARAMS,
                deadline,
                on_region,
                self.options,
            ),
            f"Tanz broadcast {list(sources)} -> {list(dests)}",
            [*sources, *dests],
            cancelled,
        )

    def _run(
        self,
        move: Callable[[], None],
        what: str,
        members: Sequence[int],
        cancelled: threading.Event | None = None,
    ) -> None:
        start = time.perf_counter()
        try:
            with aborting(cancelled, lambda: self._abort(members, f"{what}: the caller cancelled")):
                move()
        except TransferError as exc:
            self._forget_confirmations(members, what)
            raise replica_error(exc, what) from exc
        except ValueError as exc:  # the transfer layer's own argument checks
            raise InvalidArgument(f"{what}: {exc}") from exc
        seconds = max(time.perf_counter() - start, 1e-9)
        nbytes = self.store.layout.total_bytes
        log.info(
            "rank %d, %s: %.1f MB in %.3f s (%.2f GB/s)",
            self.rank,
            what,
            nbytes / 1e6,
            seconds,
            nbytes / seconds / 1e9,
        )

    def abort(self, members: Sequence[int], reason: str) -> None:
        """Fail every transfer of this rank's part with `members` at once, confirmations included."""
        self._abort(members, reason)

    def _abort(self, members: Sequence[int], reason: str) -> None:
        """Fail every transfer of this rank's part at once (the peers see the reset and fail too)."""
        for peer in members:
            if peer != self.rank:
                self.fabric.abort(peer, Stream.PARAMS, reason)
                self.fabric.abort(peer, control_stream(Stream.PARAMS), reason)

    def _forget_confirmations(self, members: Sequence[int], what: str) -> None:
        """After a failed collective, drop its confirmation connections (both directions).

        A failed attempt can leave unread completion records (or a verdict still being sent to a
        dead rank) on the control stream; a retry would otherwise read them as its own. Every rank
        drops them when its attempt fails, which is before any retry starts (the caller retries
        only after WaitRdmaDone/Broadcast returned on every member).
        """
        for peer in members:
            if peer != self.rank:
                self.fabric.abort(peer, control_stream(Stream.PARAMS), f"{what} failed")
