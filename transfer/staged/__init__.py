"""Device buffers over a host-memory fabric (tcp): staged through pinned host slots."""

from transfer.staged.fabric import StagedFabric

__all__ = ["StagedFabric"]
