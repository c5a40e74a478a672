"""CUDA devices from `nvidia-smi --query-gpu` (or torch when nvidia-smi is missing).

The query is `nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,nounits`,
one line per device:

    0, NVIDIA H100 80GB HBM3, 81559, 00000000:18:00.0

`parse_query` is pure (tested on recorded outputs); `query` runs the tool with a deadline.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits"]

NO_DEVICES = "No devices were found"


@dataclass(frozen=True)
class GpuRecord:
    """One line of the query."""

    index: int
    name: str
    memory_mib: int
    pci_bus_id: str  # sysfs spelling (see `sysfs_bus_id`)


class NvidiaSmiError(RuntimeError):
    """nvidia-smi ran but its answer cannot be read."""


def sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's "00000000:18:00.0" as sysfs spells it, "0000:18:00.0" (4-digit domain, lower case)."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep or not rest:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"


def parse_query(text: str) -> list[GpuRecord]:
    """The devices of one `QUERY` output; an output saying no devices gives []."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or NO_DEVICES in line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            raise NvidiaSmiError(f"nvidia-smi line {number}: expected 4 fields, got {line!r}")
        index, memory, bus = fields[0], fields[-2], fields[-1]
        name = ", ".join(fields[1:-2])  # a name with a comma in it keeps it
        if not index.isdigit():
            raise NvidiaSmiError(f"nvidia-smi line {number}: index {index!r} is not a number")
        memory_mib = int(memory) if memory.isdigit() else 0  # "[N/A]" on some boards
        records.append(GpuRecord(int(index), name, memory_mib, sysfs_bus_id(bus)))
    return records


def query(timeout: float = 20.0) -> str | None:
    """`QUERY`'s output, or None when nvidia-smi is not installed or finds no device."""
    if shutil.which(QUERY[0]) is None:
        return None
    try:
        done = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NvidiaSmiError(f"nvidia-smi did not answer: {exc}") from exc
    if done.returncode != 0:
        if NO_DEVICES in done.stdout + done.stderr:
            return None
        raise NvidiaSmiError(f"nvidia-smi exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout


def driver_present(root: Path = Path("/")) -> bool:
    """Whether an NVIDIA driver is loaded (checked before importing torch for its device count)."""
    return (root / "proc/driver/nvidia").exists() or (root / "dev/nvidia0").exists()


def torch_records() -> list[GpuRecord]:
    """The devices torch sees (no PCI address: torch does not give the sysfs one)."""
    import torch  # only where a driver exists and nvidia-smi does not: the import takes seconds

    if not torch.cuda.is_available():
        return []
    records = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        records.append(GpuRecord(index, props.name, props.total_memory // (1 << 20), ""))
    return records
