"""A virtual-time cluster: simulated replicas on a virtual network behind the router's own scheduler.

```
 EngineSpec + roles + topology ─► VirtualReplica per rank (the shared Engine over a SimRunner)
                                      on Hardware (network.py: each rank's paced links)
 router flags ─► RouterConfig ─► ClusterScheduler (router/scheduler.py, unchanged): the batcher, the
                 loops, the migration queue and strategies, the autoscaler (planner + executor),
                 on the virtual clock, connected to the replicas in process (`connect`)
```
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcluster.cluster.engine import EngineSpec
from pdcluster.sim.flags import with_flags
from pdcluster.sim.hardware import Hardware
from pdcluster.sim.network import Network, RankPlace
from pdcluster.sim.replica import VirtualReplica
from replica.config import EngineKind, ReplicaConfig
from replica.engine.sim.clock import TallyClock
from replica.engine.sim.cost import kv_bytes_per_token
from replica.engine.sim.factory import build_simulated
from replica.model.layout import ITEMSIZE, WeightLayout
from replica.params.store import ParamStore
from router.config import RouterConfig
from router.models import ModelSpec
from router.pools import ModelPools
from router.replica_api import ReplicaApi
from router.replicas import State
from router.scheduler import ClusterScheduler
from router.serve_models import model_config
from router.types import Scheduler

VIRTUAL_BYTE_SCALE = "1e-12"
"""The replicas' own buffers are no more than a byte per page and region: the virtual network
counts the card's real bytes itself."""


class SilentDecoder:
    """The router's detokenizer for replicas without a tokenizer: every text is empty."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """No text."""
        return ""


@dataclass(frozen=True)
class VirtualShape:
    """What one virtual cluster is made of."""

    roles: tuple[str, ...]
    engine: EngineSpec
    places: tuple[RankPlace, ...]
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    num_blocks: int | None = None


def replica_config(shape: VirtualShape, rank: int, role: str) -> ReplicaConfig:
    """Rank `rank`'s replica flags, as its process would get them (the byte scale aside)."""
    e = shape.engine
    base: dict[str, Any] = {
        "port": 0, "rank": rank, "engine": EngineKind.SIMULATED, "gpu": e.gpu, "model_card": e.model_card,
        "profile": e.profile, "byte_scale": VIRTUAL_BYTE_SCALE, "compute_efficiency": e.compute_efficiency,
        "memory_efficiency": e.memory_efficiency, "num_blocks": shape.num_blocks,
        "inactive": role == "inactive",
    }
    config = with_flags(ReplicaConfig, base, shape.replica_args)
    return config


def build_replicas(shape: VirtualShape, hw: Hardware) -> list[VirtualReplica]:
    """One virtual replica per role."""
    replicas = []
    for rank, role in enumerate(shape.roles):
        config = replica_config(shape, rank, role)
        clock = TallyClock()
        engine, params = build_simulated(config, clock)
        _scale_host_cache(config, params, engine.runner.config, engine.meta.dtype)
        replica = VirtualReplica(rank, engine, params, clock, hw, config.disk_gbps, config.host_gbps)
        hw.replicas[rank] = replica
        replicas.append(replica)
    return replicas


class VirtualCluster:
    """The replicas and the router's scheduler of one virtual-time run."""

    def __init__(self, shape: VirtualShape, strategy: str, policy: str, timeline: Path | None) -> None:
        self.shape = shape
        base: dict[str, Any] = {"model": Path(shape.engine.model_card), "strategy": strategy,
                                "scaling": policy,
                                "timeline": timeline}
        self.router_config = with_flags(RouterConfig, base, shape.router_args)
        self.hw = Hardware(Network(shape.places), self.router_config.transfer_timeout)
        self.replicas = build_replicas(shape, self.hw)
        self.scheduler: ClusterScheduler | None = None
        self.pools: ModelPools | None = None  # several models (`--models` in the router args)
        self.fronts: dict[str, Scheduler] = {}  # each model's Scheduler when several

    def _model_scheduler(self, spec: ModelSpec, first: bool, connect: Callable[[str], ReplicaApi],
                         kv_bytes: int, ids: Iterator[int]) -> ClusterScheduler:
        """One model's scheduler; every model writes the one timeline (one clock, ids unique)."""
        config = dataclasses.replace(model_config(self.router_config, spec, first),
                                     timeline=self.router_config.timeline)
        return ClusterScheduler(config, SilentDecoder(), connect, kv_bytes_per_token=kv_bytes,
                                clock=asyncio.get_running_loop().time, ids=ids)

    async def _start_models(self, connect: Callable[[str], ReplicaApi], kv_bytes: int,
                            weight_bytes: int) -> ClusterScheduler:
        """Several models of the replicas' card: the loaded replicas are dealt to the models in turn,
        each role on its own (as a static deployment provisions every model: 4 prefill and 4 decode
        replicas give 4 models one of each); the inactive ones are the shared spare pool
        (`router/pools.py`)."""
        specs, ids = self.router_config.model_specs(), itertools.count(0)
        scheds = {s.name: self._model_scheduler(s, i == 0, connect, kv_bytes, ids)
                  for i, s in enumerate(specs)}
        spare, dealt = [], Counter[str]()
        for replica, role, place in zip(self.replicas, self.shape.roles, self.shape.places, strict=True):
            _keep_host_models(replica.weights.params, place.host_models)
            if role == "inactive":
                _name_host_copy(replica.weights.params, specs[0].path.name)
                spare.append(replica.address)
                continue
            spec = specs[dealt[role] % len(specs)]
            dealt[role] += 1
            replica.weights.params.model_name = spec.path.name  # its host copy's name at a reset
            await scheds[spec.name].add_replica(replica.address, State(role))
        for sched in scheds.values():
            sched.weight_bytes = weight_bytes
        config = self.router_config
        self.pools = ModelPools(scheds, spare, config.wake_timeout, config.plan_interval)
        await self.pools.start()
        self.fronts = {name: self.pools.front(name) for name in scheds}
        return scheds[specs[0].name]

    async def start(self) -> ClusterScheduler:
        """The scheduler over every replica, started (the caller's loop is the virtual one)."""
        by_address = {r.address: r for r in self.replicas}

        def connect(address: str) -> ReplicaApi:
            return by_address[address]

        first = self.replicas[0]
        config, dtype = first.engine.runner.config, first.engine.meta.dtype
        kv_bytes = kv_bytes_per_token(config, ITEMSIZE[dtype])
        weight_bytes = WeightLayout.for_config(config, dtype).total_bytes
        if self.router_config.models:
            self.scheduler = await self._start_models(connect, kv_bytes, weight_bytes)
            return self.scheduler
        loop = asyncio.get_running_loop()
        sched = ClusterScheduler(self.router_config, SilentDecoder(), connect, kv_bytes_per_token=kv_bytes,
                                 clock=loop.time)
        sched.weight_bytes = weight_bytes
        for replica, role in zip(self.replicas, self.shape.roles, strict=True):
            await sched.add_replica(replica.address, State(role))
        await sched.start()
        self.scheduler = sched
        return sched

    async def stop(self) -> None:
        """Stop the scheduler (its loops, the autoscaler); every model's when several."""
        if self.pools is not None:
            await self.pools.stop()
        elif self.scheduler is not None:
            await self.scheduler.stop()


def _keep_host_models(params: ParamStore, names: Sequence[str]) -> None:
    """The node's host memory holds these models at start (topology `host_models`): a host copy of
    each, in order, within `--host-cache-bytes` (a simulated copy: only its size counts)."""
    for name in names:
        params.host_cache.put(name, params.io.empty_copy(params.buffer), params.layout.total_bytes)


def _name_host_copy(params: ParamStore, name: str) -> None:
    """An inactive replica started with the card's host copy (`--host-cache`) holds the first model
    (the card it was started with): its copy and its buffer's name are that model's."""
    if params.model_name:
        return
    params.model_name = name
    copy = params.host_cache.peek("")
    if copy is not None:  # re-keyed: the unnamed copy is evicted first when both do not fit
        params.host_cache.put(name, copy, params.layout.total_bytes)


def _scale_host_cache(config: ReplicaConfig, params: ParamStore, card: Any, dtype: str) -> None:
    """`--host-cache-bytes` in the card's real bytes, kept as the same share of a model's bytes in
    the virtual replica's tiny buffer (at VIRTUAL_BYTE_SCALE a byte count rounds to nothing: 16 GB of
    a 13.5 GB model is 1.19 models here too); the start-up host copy taken again under it."""
    if not config.host_cache_bytes:
        return
    real = WeightLayout.for_config(card, dtype).total_bytes
    params.host_cache.capacity = config.host_cache_bytes * params.layout.total_bytes // real
    if config.host_cache and params.host_copy is None:
        params.warm_host_copy(Path("."))
