"""`ServerState`: what the servicer and its RPC collaborators share (config, worker, engine, fabric).

One object per replica, created with the servicer; `engine` and `cluster` are set once the model
is loaded and the fabric exists (`ReplicaServicer.attach`). The collaborators (`WeightRpcs`,
`MigrationRpcs`) read it instead of inheriting the servicer's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.cluster import ReplicaCluster
from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.worker import EngineWorker


@dataclass
class ServerState:
    """Shared, mutable state of one replica's gRPC edge."""

    config: ReplicaConfig
    worker: EngineWorker
    engine: Engine | None = None  # set once the model is loaded
    cluster: ReplicaCluster | None = None  # the rank table and fabric, set with the engine
