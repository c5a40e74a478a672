"""Recorded sysfs trees for discovery tests: the links and files `pdcluster.discovery.sysfs` reads,
laid out as a real kernel lays them out (symlinks from bus/ and class/ into devices/).

```
 ROOT/devices/pci0000:17/0000:17:00.0/0000:18:00.0/numa_node        a GPU under a PCIe switch port
 ROOT/bus/pci/devices/0000:18:00.0 -> ../../../devices/pci0000:17/0000:17:00.0/0000:18:00.0
 ROOT/class/net/ibp25s0/device     -> ../../../devices/pci0000:17/0000:17:00.0/0000:19:00.0
 ROOT/devices/…/0000:19:00.0/infiniband/mlx5_0, ROOT/class/infiniband/mlx5_0/device -> …
 ROOT/devices/system/node/node0/cpulist
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pci:
    """A PCI function: its address, the bridges above it (root complex first), its NUMA node."""

    bus: str
    above: tuple[str, ...]
    numa: int = -1


@dataclass(frozen=True)
class Net:
    """A network interface: backed by `pci` (None: virtual), its speed, its RDMA device."""

    name: str
    pci: Pci | None = None
    speed_mbps: int | None = None
    rdma: str = ""


def _dir_of(root: Path, pci: Pci) -> Path:
    return root.joinpath("devices", *pci.above, pci.bus)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def build(root: Path, pcis: list[Pci], nets: list[Net], numa_cpus: dict[int, str]) -> Path:
    """Write the tree under `root` and return it."""
    for pci in pcis + [n.pci for n in nets if n.pci is not None]:
        folder = _dir_of(root, pci)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "numa_node").write_text(f"{pci.numa}\n")
        link = root / "bus/pci/devices" / pci.bus
        if not link.is_symlink():
            _link(link, folder)
    for net in nets:
        entry = root / "class/net" / net.name
        entry.mkdir(parents=True, exist_ok=True)
        if net.pci is not None:
            _link(entry / "device", _dir_of(root, net.pci))
        if net.speed_mbps is not None:
            (entry / "speed").write_text(f"{net.speed_mbps}\n")
        if net.rdma and net.pci is not None:
            (_dir_of(root, net.pci) / "infiniband" / net.rdma).mkdir(parents=True)
            _link(root / "class/infiniband" / net.rdma / "device", _dir_of(root, net.pci))
    for node, cpus in numa_cpus.items():
        folder = root / f"devices/system/node/node{node}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpulist").write_text(cpus + "\n")
    return root


# An 8-GPU node shaped like a DGX H100: two sockets, each GPU beside one 400 Gb/s RDMA NIC under
# the same PCIe switch port, GPUs 0-3 and their NICs on NUMA node 0, 4-7 on node 1; a management
# NIC on its own root port of socket 0. Bus numbers are those of the recorded nvidia-smi output.
GPU_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


def dgx_h100(root: Path) -> Path:
    """The 8-GPU node (GPU g's NIC is ibp{bus+1}s0 / mlx5_g)."""
    pcis, nets = [], []
    for g, bus in enumerate(GPU_BUSES):
        numa = 0 if g < 4 else 1
        complex_ = f"pci0000:{int(bus, 16) - 1:02x}"
        switch = f"0000:{int(bus, 16) - 1:02x}:00.0"
        pcis.append(Pci(f"0000:{bus}:00.0", (complex_, switch), numa))
        nic_bus = f"{int(bus, 16) + 1:02x}"
        nic = Pci(f"0000:{nic_bus}:00.0", (complex_, switch), numa)
        nets.append(Net(f"ibp{int(nic_bus, 16)}s0", nic, 400000, f"mlx5_{g}"))
    nets.append(Net("eno1", Pci("0000:03:00.0", ("pci0000:00", "0000:00:1c.0"), 0), 1000))
    nets.append(Net("lo"))
    return build(root, pcis, nets, {0: "0-55,112-167", 1: "56-111,168-223"})


def workstation(root: Path) -> Path:
    """One GPU on socket 0's root complex; a 25 Gb/s NIC there and a 10 Gb/s one on socket 1."""
    gpu = Pci("0000:07:00.0", ("pci0000:00", "0000:00:01.0"), 0)
    near = Net("enp5s0", Pci("0000:05:00.0", ("pci0000:00", "0000:00:1c.0"), 0), 25000)
    far = Net("enp130s0", Pci("0000:82:00.0", ("pci0000:80", "0000:80:02.0"), 1), 10000)
    return build(root, [gpu], [far, near, Net("lo"), Net("docker0")], {0: "0-15", 1: "16-31"})


def h100_vm(root: Path) -> Path:
    """A cloud VM with one H100, as recorded on one (`ls -l /sys/class/net /sys/class/infiniband`,
    the GPU's `numa_node`): the GPU at 0000:00:06.0 with no NUMA node (-1), a virtio NIC at
    0000:00:03.0 on the same root bus, two ifb devices (virtual), no RDMA device; 16 cores."""
    gpu = Pci("0000:00:06.0", ("pci0000:00",), -1)
    nic = Pci("0000:00:03.0", ("pci0000:00",), -1)
    build(root, [gpu, nic], [Net("lo"), Net("ifb0"), Net("ifb1")], {0: "0-15"})
    virtio = _dir_of(root, nic) / "virtio2"
    virtio.mkdir()
    _link(root / "class/net/eth0/device", virtio)
    (root / "class/infiniband").mkdir(parents=True)
    return root


def cpu_vm(root: Path) -> Path:
    """A CPU-only VM: a virtio NIC (its `device` is virtio0, below the PCI function), no NUMA info."""
    pci = Pci("0000:00:03.0", ("pci0000:00",), -1)
    build(root, [pci], [], {0: "0-3"})
    virtio = _dir_of(root, pci) / "virtio0"
    virtio.mkdir()
    _link(root / "class/net/eth0/device", virtio)
    (root / "class/net/lo").mkdir(parents=True)
    (root / "class/net/veth0").mkdir(parents=True)
    return root
