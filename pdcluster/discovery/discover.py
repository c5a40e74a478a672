"""Put one node's inventory together: CUDA devices, their NUMA node and nearest NIC, CPU cores.

```
 nvidia-smi --query-gpu (else torch, where a driver exists) ─┐
 /sys: NUMA of each PCI device, NICs and RDMA devices ──────┼─► assemble(...) ─► Inventory
 sched_getaffinity, interface addresses, free ports ────────┘   (pure: tests feed recorded parts)
```
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from pdcluster.discovery import nvidia
from pdcluster.discovery.checks import checkpoint_problem
from pdcluster.discovery.inventory import Gpu, Inventory, Nic
from pdcluster.discovery.sysfs import Sysfs
from transfer.ports import free_ports

_SIOCGIFADDR = 0x8915


def assemble(hostname: str, sysfs: Sysfs, gpus: list[nvidia.GpuRecord], gpu_source: str,
             allowed_cpus: Iterable[int], addresses: Mapping[str, tuple[str, ...]]) -> Inventory:
    """The inventory of recorded parts (pure but for reading `sysfs`)."""
    nics = [Nic(n.name, n.pci_bus_id, n.numa_node, n.speed_mbps, n.rdma_device, addresses.get(n.name, ()))
            for n in sysfs.nics()]
    placed = []
    for g in gpus:
        near = sysfs.nearest_nic(g.pci_bus_id, nics) if g.pci_bus_id else None
        placed.append(Gpu(g.index, g.name, g.memory_mib, g.pci_bus_id,
                          sysfs.pci_numa(g.pci_bus_id) if g.pci_bus_id else None,
                          near.name if near else "", near.rdma_device if near else ""))
    return Inventory(hostname, tuple(placed), tuple(nics), sysfs.cpus(allowed_cpus),
                     gpu_source if gpus else "")


def interface_ipv4() -> dict[str, tuple[str, ...]]:
    """The IPv4 address of each interface of this network namespace (SIOCGIFADDR; none: left out)."""
    found: dict[str, tuple[str, ...]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            found[name] = (socket.inet_ntoa(answer[20:24]),)
    return found


def nic_holding(address: str, addresses: Mapping[str, tuple[str, ...]]) -> str:
    """The interface that holds `address` (a name is resolved first); "" when none here does."""
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return ""
    return next((name for name, ips in sorted(addresses.items()) if ip in ips), "")


def gpu_records() -> tuple[list[nvidia.GpuRecord], str]:
    """This node's CUDA devices and where they were read from."""
    text = nvidia.query()
    if text is not None:
        return nvidia.parse_query(text), "nvidia-smi"
    if nvidia.driver_present():
        return nvidia.torch_records(), "torch"
    return [], ""


def visible_count(cuda_visible_devices: str | None, found: int) -> int:
    """How many of `found` devices a process sees under this `CUDA_VISIBLE_DEVICES` (None: unset).

    CUDA reads the list up to its first invalid entry ("-1" hides every device); an empty value hides
    them all. Entries may be ordinals or UUIDs ("GPU-…"); more entries than devices count as the devices.
    """
    if cuda_visible_devices is None:
        return found
    count = 0
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, found)


def visible_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """The CUDA devices a process started here would see: nvidia-smi's (else torch's, where a driver
    is loaded) narrowed by `CUDA_VISIBLE_DEVICES`; 0 on a machine without GPUs (no torch import)."""
    env = os.environ if environ is None else environ
    records, _ = gpu_records()
    return visible_count(env.get("CUDA_VISIBLE_DEVICES"), len(records))


def discover(ports: int = 0, bind: str = "", check_model: Path | None = None) -> Inventory:
    """This node's inventory; `ports` free ports drawn here; the NIC holding `bind`; the model checked."""
    addresses = interface_ipv4()
    gpus, source = gpu_records()
    inventory = assemble(socket.gethostname(), Sysfs(), gpus, source, os.sched_getaffinity(0), addresses)
    drawn = tuple(free_ports(ports, "0.0.0.0")) if ports else ()  # free on every address of this node
    problem = checkpoint_problem(check_model) if check_model is not None else ""
    return Inventory(inventory.hostname, inventory.gpus, inventory.nics, inventory.cpus, inventory.gpu_source,
                     drawn, nic_holding(bind, addresses) if bind else "", problem)
