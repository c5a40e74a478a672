"""Device discovery from recorded nvidia-smi outputs and sysfs trees: 0, 1, 3 (mixed) and 8 GPUs,
each device's NUMA node and nearest NIC, CPU-only nodes, the inventory's JSON round trip and table."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.discovery import nvidia
from pdcluster.discovery.command import table
from pdcluster.discovery.discover import assemble, nic_holding
from pdcluster.discovery.inventory import Inventory
from pdcluster.discovery.sysfs import Sysfs, parse_cpulist
from tests.helpers import sysfs_tree

RECORDED = Path(__file__).parent / "recorded"


def records(name: str) -> list[nvidia.GpuRecord]:
    return nvidia.parse_query((RECORDED / name).read_text())


def test_eight_h100s_parse_with_sysfs_bus_ids() -> None:
    gpus = records("nvidia-smi-h100x8.csv")
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"} and {g.memory_mib for g in gpus} == {81559}
    assert [g.pci_bus_id for g in gpus] == [f"0000:{b}:00.0" for b in sysfs_tree.GPU_BUSES]


def test_one_gpu_none_and_a_mixed_box() -> None:
    assert records("nvidia-smi-a100x1.csv") == [
        nvidia.GpuRecord(0, "NVIDIA A100-SXM4-40GB", 40960, "0000:07:00.0")
    ]
    assert records("nvidia-smi-none.txt") == []
    mixed = records("nvidia-smi-mixed.csv")
    assert [(g.name, g.memory_mib) for g in mixed] == [
        ("NVIDIA GeForce RTX 4090", 24564),
        ("NVIDIA RTX A6000", 49140),
        ("NVIDIA T4", 0),
    ]  # [N/A]: 0


def test_bad_lines_are_refused_and_names_with_commas_kept() -> None:
    with pytest.raises(nvidia.NvidiaSmiError, match="line 1"):
        nvidia.parse_query("0, only two\n")
    with pytest.raises(nvidia.NvidiaSmiError, match="index"):
        nvidia.parse_query("x, GPU, 1, 00000000:01:00.0\n")
    assert nvidia.parse_query("3, Odd, Inc. GPU, 1024, 00000000:01:00.0")[0].name == "Odd, Inc. GPU"
    assert nvidia.sysfs_bus_id("00000001:AB:00.1") == "0001:ab:00.1"


def test_dgx_each_gpu_gets_its_numa_node_and_the_rdma_nic_on_its_switch(tmp_path: Path) -> None:
    sysfs = Sysfs(sysfs_tree.dgx_h100(tmp_path))
    inv = assemble(
        "dgx", sysfs, records("nvidia-smi-h100x8.csv"), "nvidia-smi", range(224), {"eno1": ("10.0.0.5",)}
    )
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.rdma_device for g in inv.gpus] == [f"mlx5_{i}" for i in range(8)]
    assert inv.gpus[0].nic == "ibp25s0" and inv.gpus[7].nic == "ibp220s0"
    assert sorted(inv.rdma_devices) == [f"mlx5_{i}" for i in range(8)]
    eno = next(n for n in inv.nics if n.name == "eno1")
    assert (eno.speed_mbps, eno.rdma_device, eno.ipv4, eno.numa_node) == (1000, "", ("10.0.0.5",), 0)
    assert "lo" not in {n.name for n in inv.nics}  # no hardware behind it
    assert len(inv.cpus.numa[0]) == len(inv.cpus.numa[1]) == 112


def test_workstation_gpu_takes_the_nic_on_its_own_root_complex(tmp_path: Path) -> None:
    sysfs = Sysfs(sysfs_tree.workstation(tmp_path))
    inv = assemble("ws", sysfs, records("nvidia-smi-a100x1.csv"), "nvidia-smi", range(32), {})
    assert (inv.gpus[0].nic, inv.gpus[0].numa_node, inv.gpus[0].rdma_device) == ("enp5s0", 0, "")
    assert sorted(n.name for n in inv.nics) == ["enp130s0", "enp5s0"]  # docker0, lo: virtual


def test_a_recorded_h100_vm_gpu_without_numa_takes_the_virtio_nic(tmp_path: Path) -> None:
    """nvidia-smi's answer and the sysfs layout recorded on a real single-H100 cloud VM."""
    gpus = records("nvidia-smi-h100x1-vm.csv")
    assert gpus == [nvidia.GpuRecord(0, "NVIDIA H100 80GB HBM3", 81559, "0000:00:06.0")]
    sysfs = Sysfs(sysfs_tree.h100_vm(tmp_path))
    inv = assemble("h100", sysfs, gpus, "nvidia-smi", range(16), {"eth0": ("10.0.0.9",)})
    gpu = inv.gpus[0]
    assert (gpu.numa_node, gpu.nic, gpu.rdma_device) == (None, "eth0", "")  # numa_node -1: unknown
    assert [n.name for n in inv.nics] == ["eth0"] and inv.rdma_devices == ()  # ifb0, ifb1, lo: virtual
    assert "cuda:0  NVIDIA H100 80GB HBM3  80 GiB  0000:00:06.0  -" in table(inv)


def test_cpu_only_vm_finds_its_virtio_nic_and_no_gpu(tmp_path: Path) -> None:
    sysfs = Sysfs(sysfs_tree.cpu_vm(tmp_path))
    inv = assemble("vm", sysfs, [], "", [0, 1, 2, 3], {"eth0": ("192.0.2.2",), "lo": ("127.0.0.1",)})
    assert inv.gpus == () and inv.gpu_source == ""
    assert [(n.name, n.pci_bus_id, n.numa_node) for n in inv.nics] == [("eth0", "0000:00:03.0", None)]
    assert inv.cpus.cores == (0, 1, 2, 3) and inv.cpus.numa == {0: (0, 1, 2, 3)}
    assert "no CUDA device" in table(inv)


def test_affinity_limits_the_cores_and_numa_groups_them(tmp_path: Path) -> None:
    sysfs = Sysfs(sysfs_tree.workstation(tmp_path))
    cpus = sysfs.cpus([2, 3, 17])
    assert cpus.cores == (2, 3, 17) and cpus.numa == {0: (2, 3), 1: (17,)} and cpus.numa_of(17) == 1
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_inventory_round_trips_through_json_and_prints_a_table(tmp_path: Path) -> None:
    sysfs = Sysfs(sysfs_tree.dgx_h100(tmp_path))
    inv = assemble("dgx", sysfs, records("nvidia-smi-h100x8.csv"), "nvidia-smi", range(224), {})
    assert Inventory.from_json(inv.to_json()) == inv
    text = table(inv)
    assert "8 CUDA device(s) (from nvidia-smi)" in text
    assert "cuda:7  NVIDIA H100 80GB HBM3  80 GiB  0000:db:00.0  1     ibp220s0  mlx5_7" in text
    with pytest.raises(ValueError, match="not a device inventory"):
        Inventory.from_json('{"hostname": "x"}')


def test_the_nic_holding_an_address() -> None:
    addresses = {"eth0": ("10.1.0.2",), "lo": ("127.0.0.1",)}
    assert nic_holding("10.1.0.2", addresses) == "eth0"
    assert nic_holding("10.9.9.9", addresses) == ""
