"""`pdcluster router --models …`: one scheduler per model, the replicas sorted among them by Info.

A replica with weights joins the model its Info names (`weights_model`: what its buffer holds; from
an older replica `model_id`: a model's name or its checkpoint folder's name); an inactive one joins
the shared spare pool (`router/pools.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

from router.config import RouterConfig
from router.errors import ReplicaCallError
from router.metrics import RouterMetrics
from router.models import ModelSpec
from router.pools import ModelPools
from router.replica_api import Connect
from router.replicas import State
from router.scheduler import ClusterScheduler
from router.tokenizer import Tokenizer
from router.types import ReplicaInfo

Sizes = Callable[[Path, str], int]  # (checkpoint, dtype) → bytes: kv_bytes_per_token, weight_bytes


def model_config(config: RouterConfig, spec: ModelSpec, first: bool) -> RouterConfig:
    """The config of one model's scheduler: its checkpoint, name and bounds; a timeline of its own
    (`T.NAME.jsonl` beside `--timeline T.jsonl`, the first model's is `--timeline` itself)."""
    timeline = config.timeline
    if timeline is not None and not first:
        timeline = timeline.with_name(f"{timeline.stem}.{spec.name}{timeline.suffix}")
    return dataclasses.replace(config, model=spec.path, model_id=spec.name, models=[], timeline=timeline,
                               **spec.overrides)  # type: ignore[arg-type]


def owner(specs: list[ModelSpec], model_id: str) -> str:
    """The model a loaded replica serves (ValueError when no model is named so)."""
    for spec in specs:
        if model_id in (spec.name, spec.path.name):
            return spec.name
    raise ValueError(f"a replica serves model {model_id!r}, which neither --model nor --models names "
                     f"({', '.join(s.name for s in specs)})")


async def probe(connect: Connect, address: str, deadline: float) -> ReplicaInfo:
    """A replica's Info, retrying while it is still starting (until `deadline`, loop time)."""
    loop = asyncio.get_running_loop()
    while True:
        client = connect(address)
        try:
            return await client.info()
        except ReplicaCallError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await client.close()


async def build_pools(config: RouterConfig, metrics: RouterMetrics, connect: Connect, deadline: float,
                      kv_bytes: Sizes, weight_bytes: Sizes) -> tuple[ModelPools, dict[str, Tokenizer]]:
    """Every model's scheduler with the replicas that serve it, and the spare pool."""
    specs, ids = config.model_specs(), itertools.count(0)
    tokenizers = {s.name: Tokenizer.from_model_dir(s.path) for s in specs}
    scheds = {s.name: ClusterScheduler(model_config(config, s, i == 0), tokenizers[s.name], connect, metrics,
                                       ids=ids) for i, s in enumerate(specs)}
    spare = []
    for address, role in zip(config.replica, config.roles(), strict=True):
        info = await probe(connect, address, deadline)
        if info.loaded:
            await scheds[owner(specs, info.weights_model or info.model_id)].add_replica(address, State(role))
        else:
            spare.append(address)
    for spec in specs:
        sched = scheds[spec.name]
        dtype = next((h.state.info.dtype for h in sched.replicas.values()), "float32")
        sched.kv_bytes_per_token = kv_bytes(spec.path, dtype)
        sched.weight_bytes = weight_bytes(spec.path, dtype)
    return ModelPools(scheds, spare, config.wake_timeout, config.plan_interval), tokenizers
