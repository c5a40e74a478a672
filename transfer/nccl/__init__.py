"""The NCCL fabric (cupy's NCCL bindings); cupy is imported only when this fabric is created."""
