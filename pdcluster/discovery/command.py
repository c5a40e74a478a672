"""`pdcluster devices`: this node's CUDA devices, NICs and CPU cores, as a table or as JSON.

`pdcluster launch` runs `pdcluster devices --json --ports N --bind ADDR --check-model DIR` on every
node (over ssh or srun) and places replicas from the answers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.discovery.inventory import Inventory


@dataclass
class DevicesConfig:
    """Flags of `pdcluster devices`."""

    json_out: bool = field(default=False, metadata={"help": "print one JSON object (for scripts)",
                                                     "flag": "--json"})
    ports: int = field(default=0, metadata={"help": "also draw N ports free on this node (the launch does)"})
    bind: str = field(default="", metadata={"help": "name the interface that holds this address"})
    check_model: Path | None = field(default=None, metadata={"help": (
        "say whether this checkpoint folder is usable here")})

    def __post_init__(self) -> None:
        if self.ports < 0:
            raise ValueError(f"--ports must be >= 0, got {self.ports}")
        if self.check_model is not None:
            self.check_model = Path(self.check_model)


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib else "?"


def _speed(mbps: int | None) -> str:
    return f"{mbps // 1000} Gb/s" if mbps and mbps >= 1000 else (f"{mbps} Mb/s" if mbps else "-")


def _numa(node: int | None) -> str:
    return "-" if node is None else str(node)


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def table(inv: Inventory) -> str:
    """The human-readable form: one row per device, then the NICs, then the CPU cores."""
    source = f" (from {inv.gpu_source})" if inv.gpu_source else ""
    lines = [f"host {inv.hostname}: {len(inv.gpus)} CUDA device(s){source}, "
             f"{len(inv.cpus.cores)} CPU core(s), {len(inv.nics)} NIC(s)"]
    if inv.gpus:
        rows = [["DEVICE", "NAME", "MEMORY", "PCI", "NUMA", "NIC", "RDMA"]]
        rows += [[g.device, g.name, _gib(g.memory_mib), g.pci_bus_id or "-", _numa(g.numa_node), g.nic or "-",
                  g.rdma_device or "-"] for g in inv.gpus]
        lines += _columns(rows)
    else:
        lines.append("no CUDA device: replicas here are CPU workers (one per node, or cpu_replicas = N)")
    if inv.nics:
        rows = [["NIC", "PCI", "NUMA", "SPEED", "RDMA", "IPV4"]]
        rows += [[n.name, n.pci_bus_id or "-", _numa(n.numa_node), _speed(n.speed_mbps), n.rdma_device or "-",
                  ",".join(n.ipv4) or "-"] for n in inv.nics]
        lines += _columns(rows)
    numa = "; ".join(f"NUMA {node}: {_ranges(cores)}" for node, cores in sorted(inv.cpus.numa.items()))
    lines.append(f"cpu cores {_ranges(inv.cpus.cores)}" + (f" ({numa})" if numa else ""))
    if inv.transfer_nic:
        lines.append(f"transfer address on {inv.transfer_nic}")
    if inv.ports:
        lines.append(f"free ports: {' '.join(map(str, inv.ports))}")
    if inv.model_problem:
        lines.append(f"model: {inv.model_problem}")
    return "\n".join(lines)


def _ranges(cores: tuple[int, ...]) -> str:
    """"0-3,8" for (0, 1, 2, 3, 8)."""
    spans: list[str] = []
    start = prev = None
    for core in sorted(cores):
        if prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            spans.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = core
    if start is not None:
        spans.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(spans) or "-"


def run(config: DevicesConfig) -> int:
    """Entry point of `pdcluster devices`."""
    from pdcluster.discovery.discover import discover
    from pdcluster.discovery.nvidia import NvidiaSmiError

    try:
        inventory = discover(config.ports, config.bind, config.check_model)
    except (NvidiaSmiError, RuntimeError) as exc:
        print(f"pdcluster devices: {exc}", file=sys.stderr)
        return 1
    print(inventory.to_json() if config.json_out else table(inventory), flush=True)
    return 0
