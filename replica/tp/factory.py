"""The engine of a tensor-parallel replica (`--tp N`): rank 0's shard, a `TpRunner`, the workers.

Called by the replica server (`replica.server.main`) when `config.tp > 1`; everything else
(limits, detokenizer, readiness, the parameter store over rank 0's shard) is the engine's usual.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from pathlib import Path

from replica.config import ReplicaConfig
from replica.engine.detokenizer import Detokenizer
from replica.engine.device import DeviceChoice, choose
from replica.engine.engine import Engine, EngineMeta
from replica.engine.validation import derive_limits
from replica.model.config import ModelConfig
from replica.params.readiness import ParamReadiness
from replica.params.store import ParamStore
from replica.tp.leader import Endpoints, start_group
from replica.tp.rank import RankSpec
from replica.tp.runner import TpRunner

log = logging.getLogger(__name__)


def _meta(config: ReplicaConfig, choice: DeviceChoice) -> EngineMeta:
    # no CUDA graphs: a replayed graph would skip the step's broadcast to the workers
    return EngineMeta(model_id=config.name, dtype=choice.dtype.value, device_type=choice.device.type,
                      device=str(choice.device), gpu_name=choice.gpu_name,
                      attention_backend=choice.attention_backend, prefix_cache=config.prefix_cache)


def build_tp_engine(config: ReplicaConfig) -> tuple[Engine, ParamStore]:
    """Start the group (rank 0 here) and make the engine over its runner."""
    choice = choose(config)
    meta = _meta(config, choice)
    assert config.model is not None and config.num_blocks is not None  # ReplicaConfig checked both
    spec = RankSpec(Path(config.model), choice.torch_dtype, config.num_blocks, config.block_size,
                    choice.attention_backend, config.inactive)
    endpoints = Endpoints.of(Path(config.cluster) if config.cluster else None, config.rank, config.tp,
                             config.fabric)
    leader = start_group(spec, config.tp, choice.device, config.tp_timeout, endpoints=endpoints)
    atexit.register(leader.stop)
    model_config = ModelConfig.from_dir(Path(config.model))
    weights = leader.runner.group_weights  # set when every rank has a fabric endpoint
    if weights is None and config.inactive:
        leader.stop()
        first, last = config.rank + 1, config.rank + config.tp - 1
        raise ValueError(f"--inactive --tp {config.tp} needs every rank of the group in the rank table "
                         f"(ranks {first}..{last} with tp_group {config.rank}): the weights come to each")
    readiness = weights.readiness if weights is not None else ParamReadiness(model_config.num_layers)
    root = config.model_root or Path(config.model).resolve().parent
    # rank 0's shard: the workers run their parts of weight operations themselves (weights.py)
    params = ParamStore(leader.rank.layout, leader.rank.buffer, readiness, root, config.disk_gbps,
                        config.host_gbps)
    log.info("tensor-parallel group of %d ranks: %d pages of %d tokens per rank", config.tp,
             config.num_blocks, config.block_size)
    detok = Detokenizer.from_model_dir(Path(config.model))
    limits = derive_limits(config, model_config)
    return Engine(leader.runner, detok, limits, meta, readiness), params


def when_group_broken(engine: Engine, callback: Callable[[str], None]) -> None:
    """Call `callback(reason)` once the engine's tensor-parallel group breaks (a rank died or missed
    a collective's deadline): the replica server then leaves so its supervisor restarts the group."""
    if isinstance(engine.runner, TpRunner):
        engine.runner.group.when_broken(callback)
