"""NUMA nodes, NICs and the PCI tree from sysfs, under a root that tests point at a recorded tree.

```
 /sys/bus/pci/devices/0000:18:00.0 ──► ../../../devices/pci0000:17/0000:17:00.0/0000:18:00.0
                                                           └── the same switch ──┐
 /sys/class/net/ibp24s0/device     ──► ../../../devices/pci0000:17/0000:17:00.0/0000:19:00.0
                                         (infiniband/mlx5_0 beside it: an RDMA NIC)
```
The NIC "closest" to a device is the one whose PCI path shares the longest prefix with the device's
(same switch, then same root complex), then the same NUMA node; RDMA NICs first among equals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from pdcluster.discovery.inventory import Cpus, Nic

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def parse_cpulist(text: str) -> list[int]:
    """Cores of a sysfs cpu list ("0-3,8,10-11")."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        cores += range(int(low), int(high) + 1) if sep else [int(low)]
    return cores


class Sysfs:
    """Reads one sysfs tree (`/sys` on a node, a recorded folder in tests)."""

    def __init__(self, root: Path = Path("/sys")) -> None:
        self.root = root

    def _read(self, path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError):  # EINVAL: `speed` of a link that is down
            return None

    def _numa(self, device_dir: Path) -> int | None:
        text = self._read(device_dir / "numa_node")
        if text is None or not text.lstrip("-").isdigit() or int(text) < 0:
            return None  # -1: the platform does not say
        return int(text)

    def pci_numa(self, bus_id: str) -> int | None:
        """NUMA node of PCI device `bus_id` (None when unknown)."""
        return self._numa(self.root / "bus/pci/devices" / bus_id)

    def pci_path(self, bus_id: str) -> tuple[str, ...]:
        """The PCI path of a device: its resolved folder's parts below `devices/` (empty if absent)."""
        return self._path_of(self.root / "bus/pci/devices" / bus_id)

    def _path_of(self, link: Path) -> tuple[str, ...]:
        if not link.exists():
            return ()
        parts = link.resolve().parts
        top = self.root.resolve().parts
        return tuple(parts[len(top):])

    def nics(self) -> list[Nic]:
        """Interfaces backed by a PCI device, and RDMA devices without an interface."""
        found: list[Nic] = []
        seen_rdma: set[str] = set()
        net = self.root / "class/net"
        for entry in sorted(net.iterdir()) if net.is_dir() else []:
            pci = _pci_of(entry / "device")
            if pci is None:
                continue  # loopback, veth, bridge: no hardware behind it
            bus, device = pci.name, pci
            rdma = self._rdma_under(entry / "device") or self._rdma_under(pci)
            seen_rdma.update(rdma)
            speed = self._read(entry / "speed")
            found.append(Nic(entry.name, bus, self._numa(device),
                             int(speed) if speed and speed.isdigit() and int(speed) > 0 else None,
                             rdma[0] if rdma else ""))
        found += [nic for nic in self._bare_rdma() if nic.rdma_device not in seen_rdma]
        return found

    def _rdma_under(self, device: Path) -> list[str]:
        folder = device / "infiniband"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def _bare_rdma(self) -> list[Nic]:
        """RDMA devices whose PCI function has no network interface (InfiniBand-only ports)."""
        folder = self.root / "class/infiniband"
        nics = []
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            pci = _pci_of(entry / "device")
            nics.append(Nic(entry.name, pci.name if pci else "", self._numa(pci) if pci else None, None,
                            entry.name))
        return nics

    def nic_path(self, nic: Nic) -> tuple[str, ...]:
        """The PCI path of a NIC's device."""
        return self.pci_path(nic.pci_bus_id) if nic.pci_bus_id else ()

    def nearest_nic(self, bus_id: str, nics: Iterable[Nic]) -> Nic | None:
        """The NIC closest to PCI device `bus_id` on the PCI tree (None when there is no NIC)."""
        own = self.pci_path(bus_id)
        numa = self.pci_numa(bus_id)

        def distance(nic: Nic) -> tuple[int, int, int, str]:
            shared = _common_prefix(own, self.nic_path(nic))
            same_numa = numa is not None and nic.numa_node == numa
            return (-shared, -int(same_numa), -int(bool(nic.rdma_device)), nic.name)

        candidates = [n for n in nics if n.pci_bus_id]
        return min(candidates, key=distance) if candidates else None

    def cpus(self, allowed: Iterable[int]) -> Cpus:
        """The `allowed` cores, with the NUMA node of each from `devices/system/node`."""
        usable = sorted(set(allowed))
        numa: dict[int, tuple[int, ...]] = {}
        nodes = self.root / "devices/system/node"
        for entry in sorted(nodes.glob("node[0-9]*")) if nodes.is_dir() else []:
            text = self._read(entry / "cpulist")
            if text is None:
                continue
            mine = tuple(c for c in parse_cpulist(text) if c in usable)
            if mine:
                numa[int(entry.name[4:])] = mine
        return Cpus(tuple(usable), numa)


def _pci_of(device: Path) -> Path | None:
    """The PCI function a device link leads to: itself, or its nearest PCI parent (virtio-net sits
    below one); None for virtual interfaces."""
    if not device.exists():
        return None
    resolved = device.resolve()
    for folder in (resolved, *resolved.parents):
        if _PCI_ADDRESS.match(folder.name):
            return folder
    return None


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count

