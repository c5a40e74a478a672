"""The GPUs a simulated replica can be: peak dense compute, memory bandwidth, memory (pure data).

Figures are the vendors' datasheet peaks for dense 16-bit tensor math (no sparsity) and HBM/GDDR
bandwidth; a step reaches a share of them (`--compute-efficiency`, `--memory-efficiency`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model."""

    name: str
    tflops: float  # dense bf16/fp16 tensor TFLOP/s
    mem_gbps: float  # memory bandwidth, GB/s (10^9 bytes)
    memory_gib: float  # device memory, GiB

    @property
    def flops(self) -> float:
        """Peak FLOP/s."""
        return self.tflops * 1e12

    @property
    def mem_bytes_per_s(self) -> float:
        """Peak memory bytes/s."""
        return self.mem_gbps * 1e9

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-40g", 312.0, 1555.0, 40.0),
        GpuSpec("a100-80g", 312.0, 2039.0, 80.0),
        GpuSpec("h100-80g", 989.0, 3350.0, 80.0),  # SXM
        GpuSpec("h100-pcie", 756.0, 2000.0, 80.0),
        GpuSpec("h200", 989.0, 4800.0, 141.0),
        GpuSpec("l40s", 362.0, 864.0, 48.0),
        GpuSpec("l4", 121.0, 300.0, 24.0),
        GpuSpec("a10", 125.0, 600.0, 24.0),
        GpuSpec("v100-32g", 125.0, 900.0, 32.0),
    )
}


def gpu(name: str) -> GpuSpec:
    """The GPU called `name` (ValueError naming the known ones)."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
