"""What one node has: CUDA devices, NICs, CPU cores, and the ports drawn free on it (plain data).

An `Inventory` is what `pdcluster devices --json` prints on a node and what `pdcluster launch`
reads back from each node (over ssh / srun) before it places replicas. It round-trips through JSON
exactly (`to_json` / `from_json`), so the launcher never guesses a field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Gpu:
    """One CUDA device as the driver numbers it (the ordinal `CUDA_VISIBLE_DEVICES` takes)."""

    index: int
    name: str
    memory_mib: int
    pci_bus_id: str = ""  # sysfs spelling, "0000:18:00.0"; empty when unknown (torch fallback)
    numa_node: int | None = None
    nic: str = ""  # the network interface closest to it on the PCI tree (empty: none found)
    rdma_device: str = ""  # that interface's RDMA device ("mlx5_0"), empty when it has none

    @property
    def device(self) -> str:
        """The rank table's spelling, "cuda:N"."""
        return f"cuda:{self.index}"


@dataclass(frozen=True)
class Nic:
    """One network interface with a PCI device (virtual ones have no PCI address)."""

    name: str
    pci_bus_id: str = ""
    numa_node: int | None = None
    speed_mbps: int | None = None  # from sysfs; None when the link is down or the driver says nothing
    rdma_device: str = ""
    ipv4: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cpus:
    """The cores this node lets a process use, grouped by NUMA node."""

    cores: tuple[int, ...]
    numa: dict[int, tuple[int, ...]] = field(default_factory=dict)  # NUMA node -> its usable cores

    def numa_of(self, core: int) -> int | None:
        """The NUMA node of `core` (None when sysfs names none)."""
        return next((node for node, cores in self.numa.items() if core in cores), None)


@dataclass(frozen=True)
class Inventory:
    """Everything discovery found on one node."""

    hostname: str
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    cpus: Cpus
    gpu_source: str = ""  # "nvidia-smi", "torch" or "" (none found)
    ports: tuple[int, ...] = ()  # free on this node when discovery ran (`--ports N`)
    transfer_nic: str = ""  # the interface holding the address given with `--bind` ("" when none does)
    model_problem: str = ""  # why the checkpoint folder given with `--check-model` is unusable ("" = fine)

    @property
    def rdma_devices(self) -> tuple[str, ...]:
        """The RDMA devices of this node's NICs."""
        return tuple(n.rdma_device for n in self.nics if n.rdma_device)

    def to_json(self) -> str:
        """One JSON object (what `pdcluster devices --json` prints)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        """Parse `to_json`'s output (ValueError when it is not an inventory)."""
        try:
            data = json.loads(text)
            return cls(
                hostname=str(data["hostname"]),
                gpus=tuple(Gpu(**g) for g in data["gpus"]),
                nics=tuple(Nic(**{**n, "ipv4": tuple(n.get("ipv4", ()))}) for n in data["nics"]),
                cpus=_cpus(data["cpus"]),
                gpu_source=str(data.get("gpu_source", "")),
                ports=tuple(int(p) for p in data.get("ports", ())),
                transfer_nic=str(data.get("transfer_nic", "")),
                model_problem=str(data.get("model_problem", "")),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a device inventory: {exc}") from exc


def _cpus(data: dict[str, Any]) -> Cpus:
    numa = {int(node): tuple(cores) for node, cores in data.get("numa", {}).items()}
    return Cpus(tuple(data["cores"]), numa)
