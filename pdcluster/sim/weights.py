"""`VirtualWeights`: a virtual replica's weight operations — p2p, chain, Tanz, LoadParams — in virtual time.

```
 SendParams ‖ RecvParams, RdmaBroadcast (each member)  ─► background part, joined by WaitRdmaDone
 SendParams of a host copy                              ─► the same p2p, read from host memory: paced
                                                           at min(the sender's link, --host-gbps)
 RecvParams from several sources, SendParams of a share ─► each source's share of the regions at once
 TanzBroadcast (each member), LoadParams                ─► blocking
 the members meet; the source schedules each target's regions (embed | layer 0 | … | head, real
 sizes) to land at  start + bytes_before_it / rate + hop · chunk / rate  (pipelined chain; a Tanz
 moves each target's bytes at about the same rate from several lanes), marking readiness as they do
```
The rules are the replica's (`replica/params`): one parameter operation at a time (a second one
is FAILED_PRECONDITION), a sender needs every region, a receiver must not hold them all
(ResetStatus first), WaitRdmaDone without a background operation is FAILED_PRECONDITION, LoadParams
from host memory needs the host copy (`--host-cache`, or an earlier ResetStatus).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from itertools import pairwise
from typing import Protocol

from pdcluster.sim.hardware import Hardware
from replica.engine.engine import Engine
from replica.errors import FailedPrecondition, ReplicaError
from replica.model.layout import WeightLayout
from replica.params.shares import share_of
from replica.params.store import ParamStore


class Owner(Protocol):
    """The virtual replica whose weights these are (`replica.VirtualReplica`)."""

    rank: int
    engine: Engine
    hw: Hardware

    def error(self, method: str, exc: ReplicaError) -> Exception:
        """The router's error for a replica error of this replica."""
        ...

CHUNK_BYTES = 4 << 20
"""A chain forwards each chunk once it has it (the transfer layer's default chunk)."""


class VirtualWeights:
    """The parameter operations of one virtual replica."""

    def __init__(self, replica: Owner, params: ParamStore, disk_gbps: float = 0.0,
                 host_gbps: float = 0.0) -> None:
        self.replica = replica
        self.params = params
        config = replica.engine.runner.config
        full = WeightLayout.for_config(config, replica.engine.meta.dtype)
        self.regions = [(r.kind, r.index, r.nbytes) for r in full.regions]
        self.total_bytes = full.total_bytes
        self.disk_rate = disk_gbps * 1e9 / 8
        self.host_rate = host_gbps * 1e9 / 8
        self.background: asyncio.Task[None] | None = None
        self.blocking = False

    # ---- guard ------------------------------------------------------------------------------------

    def _guard(self, what: str) -> None:
        if self.background is not None or self.blocking:
            raise self._error(what, FailedPrecondition(f"{what}: another parameter operation is in flight"))

    def _error(self, method: str, exc: ReplicaError) -> Exception:
        return self.replica.error(method, exc)

    def _check(self, method: str, check: Callable[[], object]) -> None:
        try:
            check()
        except ReplicaError as exc:
            raise self._error(method, exc) from None

    def _start(self, method: str, part: Awaitable[None]) -> None:
        self.background = asyncio.ensure_future(self._run(method, part))

    async def _run(self, method: str, part: Awaitable[None]) -> None:
        try:
            await part
        except ReplicaError as exc:
            raise self._error(method, exc) from None

    # ---- schedule -----------------------------------------------------------------------------------

    def _part_of(self, share: int, shares: int) -> tuple[int, int]:
        """The region range of share `share` of `shares` (0 shares: every region)."""
        if shares <= 1 and share == 0:
            return 0, len(self.regions)
        return share_of([n for _, _, n in self.regions], share, shares)

    def _land(self, rank: int, begin: float, rate: float, part: tuple[int, int] | None = None) -> float:
        """Mark `rank`'s regions (those of `part`: a range of them) ready as they would land from
        `begin` at `rate` bytes/s; the end."""
        loop, at, offset = asyncio.get_running_loop(), begin, 0
        readiness = self.replica.hw.replicas[rank].weights.params.readiness
        lo, hi = part if part is not None else (0, len(self.regions))
        for kind, index, nbytes in self.regions[lo:hi]:
            offset += nbytes
            at = begin + (offset / rate if rate > 0 else 0.0)
            loop.call_at(at, readiness.mark, kind, index)
        return at

    def _chain(self, chain: list[int], cap: float = 0.0, part: tuple[int, int] | None = None) -> float:
        """Schedule a pipelined chain chain[0] → chain[1] → … (at most `cap` bytes/s; 0: the links';
        `part`: only that range of regions); its end."""
        net, now = self.replica.hw.network, self.replica.hw.now()
        links = [net.link(a, b) for a, b in pairwise(chain)]
        rate = min((r for r in [*(link.rate for link in links), cap] if r > 0), default=0.0)
        begin = max([now, *(link.free_at for link in links)])
        hop = CHUNK_BYTES / rate if rate > 0 else 0.0
        end = max(self._land(rank, begin + j * hop, rate, part) for j, rank in enumerate(chain[1:]))
        for link in links:
            link.free_at = end
        return end

    # ---- p2p and chain (background) -------------------------------------------------------------

    def send(self, dst: int, host_copy: str = "", share: tuple[int, int] = (0, 0)) -> None:
        """SendParams: of the weight buffer, or of the host copy of model `host_copy` (read from host
        memory at `--host-gbps`, so at the slower of that and the link); only share `share[0]` of
        `share[1]` of the regions when given."""
        self._guard("SendParams")
        part = self._part_or_error(*share)
        if host_copy:
            self._check("SendParams", lambda: self.params.host_copy_to_send(host_copy))
        else:
            self._check("SendParams", lambda: self.params.require_complete(f"sending weights to rank {dst}"))
        cap = self.host_rate if host_copy else 0.0
        key = ("p2p", self.replica.rank, dst)
        self._start("SendParams", self._part(key, [self.replica.rank, dst], cap, part))

    def _part_or_error(self, share: int, shares: int) -> tuple[int, int]:
        try:
            return self._part_of(share, shares)
        except ReplicaError as exc:
            raise self._error("SendParams", exc) from None

    def _adopt(self, source: int, model: str = "") -> None:
        """A transfer fills this buffer with `model` (""): the source's): its host copy is kept under
        that name at the next ResetStatus (several models, `router/pools.py`)."""
        self.params.model_name = model or self.replica.hw.replicas[source].weights.params.model_name

    def receive(self, src: int, model: str = "", more: tuple[int, ...] = ()) -> None:
        """RecvParams (of `model`; "": the source's), from `src` and `more` at once (each its share)."""
        self._guard("RecvParams")
        self._check("RecvParams", lambda: self.params.begin_fill(f"receiving weights from rank {src}"))
        self._adopt(src, model)
        me = self.replica.rank
        parts = [self._part(("p2p", s, me), [s, me]) for s in (src, *more)]
        self._start("RecvParams", _together(parts))

    def chain(self, sources: list[int], targets: list[int]) -> None:
        """RdmaBroadcast: chain = [sources[0]] + targets."""
        chain = [sources[0], *targets]
        self._guard("RdmaBroadcast")
        self._fill_or_send("RdmaBroadcast", chain[0])
        self._start("RdmaBroadcast", self._part(("chain", tuple(chain)), chain))

    def _fill_or_send(self, method: str, source: int) -> None:
        if self.replica.rank == source:
            self._check(method, lambda: self.params.require_complete(method))
        else:
            self._check(method, lambda: self.params.begin_fill(method))
            if source >= 0:
                self._adopt(source)

    async def _part(self, key: tuple[object, ...], chain: list[int], cap: float = 0.0,
                    part: tuple[int, int] | None = None) -> None:
        meeting = await self.replica.hw.meet(key, len(chain))
        if self.replica.rank == chain[0]:
            meeting.end.set_result(self._chain(chain, cap, part))
        await meeting.ended(self.replica.hw)

    async def wait(self) -> None:
        """WaitRdmaDone: join the background part; its error, if any."""
        task = self.background
        if task is None:
            raise self._error("WaitRdmaDone",
                              FailedPrecondition("no background parameter operation to wait for"))
        try:
            await task
        finally:
            self.background = None

    # ---- blocking ----------------------------------------------------------------------------------

    async def tanz(self, sources: list[int], targets: list[int]) -> None:
        """TanzBroadcast: modelled as each lane's chain moving every target's bytes at the lane rate."""
        self._guard("TanzBroadcast")
        first = sources[0]
        self._fill_or_send("TanzBroadcast", self.replica.rank if self.replica.rank in sources else -1)
        self.blocking = True
        try:
            key = ("tanz", tuple(sources), tuple(targets))
            meeting = await self.replica.hw.meet(key, len(sources) + len(targets))
            if self.replica.rank == first:
                lanes = len(sources)
                ends = [self._chain([src, *targets[j::lanes]]) for j, src in enumerate(sources)]
                meeting.end.set_result(max(ends))
            await meeting.ended(self.replica.hw)
        except ReplicaError as exc:
            raise self._error("TanzBroadcast", exc) from None
        finally:
            self.blocking = False

    async def load(self, from_host: bool, model: str = "") -> None:
        """LoadParams of `model` (default: the replica's own) from the emulated disk or the host copy,
        region by region."""
        method = "LoadParams"
        self._guard(method)
        name = model or self.params.model_name
        if from_host and self.params.host_cache.get(name) is None:
            raise self._error(method, FailedPrecondition(
                f"host cache miss: no host-memory copy of {name or 'the weights'}"))
        self._check(method, lambda: self.params.begin_fill(method))
        self.params.model_name = name
        self.blocking = True
        try:
            rate = self.host_rate if from_host else self.disk_rate
            await self.replica.hw.sleep_until(self._land(self.replica.rank, self.replica.hw.now(), rate))
        finally:
            self.blocking = False

    def reset(self) -> None:
        """ResetStatus: the weights are unloaded (the host copy is kept)."""
        self._guard("ResetStatus")
        self.params.unload()


async def _together(parts: Sequence[Awaitable[None]]) -> None:
    """Every part at once (a receive from several sources)."""
    await asyncio.gather(*parts)
