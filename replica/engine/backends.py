"""The engine of a `ReplicaConfig`: the torch model, or a simulated GPU (`--engine simulated`).

The choice is made here so that a simulated replica never imports torch: each builder is imported
only when chosen.
"""

from __future__ import annotations

from replica.config import EngineKind, ReplicaConfig
from replica.engine.engine import Engine
from replica.params.store import ParamStore


def build_engine_and_params(config: ReplicaConfig) -> tuple[Engine, ParamStore]:
    """The engine and its parameter store for `config.engine`."""
    if config.engine is EngineKind.SIMULATED:
        from replica.engine.sim.factory import build_simulated

        return build_simulated(config)
    from replica.engine.factory import build_engine_and_params as build_torch

    return build_torch(config)
