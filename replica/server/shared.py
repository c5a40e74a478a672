"""`ServerState`: what the core and its call collaborators share (config, worker, engine, fabric).

One object per replica, created with the core; `engine` and `cluster` are set once the model
is loaded and the fabric exists (`ReplicaCore.attach`). The collaborators (`WeightCalls`,
`MigrationCalls`) read it instead of reaching into the core.
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
