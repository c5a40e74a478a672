"""`pdcluster launch` planning on discovered inventories: placement on GPUs and CPU workers (mixed
nodes), the rank table with devices and NICs, refusals naming the line, and every command line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path, PurePosixPath

import pytest

from pdcluster.cluster.clusterfile import ClusterFile, ClusterFileError, Via, parse
from pdcluster.cluster.launch_plan import (
    Commands,
    Placement,
    cpu_sets,
    place,
    ports_wanted,
    rank_table,
    router_args,
    wrap,
)
from pdcluster.cluster.security import bundle
from pdcluster.discovery.discover import assemble
from pdcluster.discovery.inventory import Cpus, Inventory
from pdcluster.discovery.nvidia import parse_query
from pdcluster.discovery.sysfs import Sysfs
from tests.helpers import sysfs_tree
from transfer.ranktable import parse_rank_table

RECORDED = Path(__file__).resolve().parents[1] / "discovery" / "recorded"

MIXED = """\
[model]
path = "/models/m"
[router]
admin_token = "t"
[launch]
fabric = "tcp"
[ssh]
options = ["ControlMaster=auto"]
[[nodes]]
name = "dgx"
address = "10.0.0.1"
transfer_address = "192.168.0.1"
nic_gbps = 400
role = "prefill"
[[nodes]]
name = "ws"
address = "10.0.0.2"
ssh_user = "serve"
ssh_port = 2222
devices = [0]
decode = 1
env = { NCCL_DEBUG = "INFO" }
[[nodes]]
name = "cpu"
address = "10.0.0.3"
devices = "cpu"
cpu_replicas = 2
decode = 1
inactive = 1
"""


def ports(n: int, base: int) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def inventories(tmp_path: Path, cluster: ClusterFile) -> dict[int, Inventory]:
    dgx = assemble(
        "dgx",
        Sysfs(sysfs_tree.dgx_h100(tmp_path / "dgx")),
        parse_query((RECORDED / "nvidia-smi-h100x8.csv").read_text()),
        "nvidia-smi",
        range(224),
        {},
    )
    ws = assemble(
        "ws",
        Sysfs(sysfs_tree.workstation(tmp_path / "ws")),
        parse_query((RECORDED / "nvidia-smi-a100x1.csv").read_text()),
        "nvidia-smi",
        range(32),
        {},
    )
    cpu = Inventory("cpu", (), (), Cpus((0, 1, 2, 3), {0: (0, 1), 1: (2, 3)}), transfer_nic="eth0")
    found = {}
    for node, inv in zip(cluster.nodes, (dgx, ws, cpu), strict=True):
        found[node.index] = Inventory(
            inv.hostname,
            inv.gpus,
            inv.nics,
            inv.cpus,
            inv.gpu_source,
            ports(ports_wanted(node), 7000 + 100 * node.index),
            inv.transfer_nic or "eno1",
        )
    return found


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[ClusterFile, list[Placement]]:
    cluster = parse(tmp_path / "c.toml", MIXED)
    return cluster, place(cluster, inventories(tmp_path, cluster))


def test_mixed_nodes_one_replica_per_gpu_and_disjoint_cpu_workers(
    mixed: tuple[ClusterFile, list[Placement]],
) -> None:
    _, placed = mixed
    assert [(p.rank, p.role, p.node.name, p.device) for p in placed] == [
        *[(i, "prefill", "dgx", f"cuda:{i}") for i in range(8)],
        (8, "decode", "ws", "cuda:0"),
        (9, "decode", "cpu", "cpu"),
        (10, "inactive", "cpu", "cpu"),
    ]
    assert [p.cuda_visible_devices for p in placed[:8]] == [str(i) for i in range(8)]
    assert [p.rdma_device for p in placed[:8]] == [f"mlx5_{i}" for i in range(8)]
    assert [p.numa_node for p in placed[:8]] == [0] * 4 + [1] * 4
    assert placed[8].nic == "enp5s0" and placed[9].nic == "eth0"
    assert (placed[9].engine_cpus, placed[10].engine_cpus) == ((0, 1), (2, 3))  # one NUMA node each
    assert (placed[9].numa_node, placed[10].cuda_visible_devices) == (0, "")
    assert [(p.port, p.transfer_port) for p in placed[:2]] == [(7000, 7001), (7002, 7003)]
    assert (placed[8].port, placed[9].port, placed[10].port) == (7100, 7200, 7202)


def test_rank_table_carries_device_nic_numa_and_rate(mixed: tuple[ClusterFile, list[Placement]]) -> None:
    _, placed = mixed
    table = parse_rank_table(rank_table(placed).to_json())
    first, last = table[0], table[10]
    assert (first.host, first.node, first.device, first.transfer_address) == (
        "10.0.0.1",
        "dgx",
        "cuda:0",
        "192.168.0.1:7001",
    )
    assert (first.nic, first.rdma_device, first.numa_node, first.nic_gbps, first.grpc_port) == (
        "ibp25s0",
        "mlx5_0",
        0,
        400.0,
        7000,
    )
    assert (last.device, last.nic, last.rdma_device, last.transfer_address) == (
        "cpu",
        "eth0",
        "",
        "10.0.0.3:7203",
    )
    assert (
        len(json.dumps(json.loads(rank_table(placed).to_json())["ranks"][0])) < 300
    )  # the README's estimate


def test_what_only_discovery_can_tell_names_the_line(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", MIXED.replace("devices = [0]", "devices = [0, 3]"))
    with pytest.raises(
        ClusterFileError, match=r"c.toml:20: ws lists CUDA device 3 but discovery found 1 \(0\)"
    ):
        place(cluster, inventories(tmp_path, cluster))
    cluster = parse(tmp_path / "c.toml", MIXED.replace('role = "prefill"', "prefill = 9"))
    with pytest.raises(ClusterFileError, match=r"c.toml:9: dgx asks for 9 replicas but has 8 CUDA device"):
        place(cluster, inventories(tmp_path / "2", cluster))
    cluster = parse(
        tmp_path / "c.toml",
        MIXED.replace("cpu_replicas = 2", "cpu_replicas = 5").replace("inactive = 1", "inactive = 4"),
    )
    with pytest.raises(ClusterFileError, match=r"c.toml:27: cpu: 5 CPU workers but only 4 cores"):
        place(cluster, inventories(tmp_path / "3", cluster))


def test_fabrics_need_what_discovery_found(tmp_path: Path) -> None:
    text = MIXED.replace('fabric = "tcp"', 'fabric = "nccl"').replace('devices = "cpu"', 'devices = "auto"')
    cluster = parse(tmp_path / "c.toml", text)
    with pytest.raises(ClusterFileError, match=r"c.toml:6: fabric nccl needs a CUDA device .* none on cpu"):
        place(cluster, inventories(tmp_path, cluster))
    cluster = parse(tmp_path / "c.toml", MIXED.replace('fabric = "tcp"', 'fabric = "rdma"'))
    with pytest.raises(
        ClusterFileError, match=r"fabric rdma needs an RDMA NIC, but discovery found none on ws"
    ):
        place(cluster, inventories(tmp_path / "2", cluster))


def test_a_node_missing_the_model_is_named(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", MIXED)
    found = inventories(tmp_path, cluster)
    found[1] = Inventory(
        "ws",
        found[1].gpus,
        (),
        found[1].cpus,
        ports=found[1].ports,
        model_problem="model folder /models/m does not exist",
    )
    with pytest.raises(ClusterFileError, match=r"c.toml:2: on ws: model folder /models/m does not exist"):
        place(cluster, found)


def test_cpu_sets_are_disjoint_and_numa_ordered() -> None:
    assert cpu_sets((0, 1, 2, 3, 4, 5), {0: (0, 2, 4), 1: (1, 3, 5)}, 2) == [(0, 2, 4), (1, 3, 5)]
    assert cpu_sets((0, 1, 2), {}, 3) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="3 CPU workers but only 2 cores"):
        cpu_sets((0, 1), {}, 3)


def commands(cluster: ClusterFile) -> Commands:
    return Commands(cluster, "RUN1", ("/venv/bin/pdcluster",), PurePosixPath("/srv/pd"))


def test_replica_script_sets_the_device_records_the_pid_and_execs(
    mixed: tuple[ClusterFile, list[Placement]],
) -> None:
    cluster, placed = mixed
    script = commands(cluster).replica_script(placed[8])
    lines = script.splitlines()
    assert lines[0] == "cd /srv/pd || exit 1"
    assert lines[1] == "echo $$ > /tmp/pdcluster-RUN1/replica-8-decode.pid || exit 1"
    assert shlex.split(lines[2]) == ["export", "CUDA_VISIBLE_DEVICES=0", "NCCL_DEBUG=INFO"]
    argv = shlex.split(lines[3])
    assert argv[:3] == ["exec", "/venv/bin/pdcluster", "replica"] and argv[-1] == "2>&1"
    for flag, value in [
        ("--rank", "8"),
        ("--fabric", "tcp"),
        ("--host", "10.0.0.2"),
        ("--port", "7100"),
        ("--cluster", "/tmp/pdcluster-RUN1/ranks.json"),
        ("--model", "/models/m"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    cpu = shlex.split(commands(cluster).replica_script(placed[10]).splitlines()[3])
    assert cpu[cpu.index("--engine-cpus") + 1 : cpu.index("--engine-cpus") + 3] == ["2", "3"]
    assert cpu[cpu.index("--torch-threads") + 1] == "2" and "--inactive" in cpu
    assert "CUDA_VISIBLE_DEVICES=''" in commands(cluster).replica_script(placed[9])


def test_ssh_srun_and_local_wrappers(mixed: tuple[ClusterFile, list[Placement]]) -> None:
    cluster, placed = mixed
    ws = placed[8].node
    ssh = wrap(Via.SSH, cluster, ws, "echo hi", tty=True)
    assert ssh[:2] == ["ssh", "-tt"] and "BatchMode=yes" in ssh and "ControlMaster=auto" in ssh
    assert (
        ssh[ssh.index("-p") + 1] == "2222" and ssh[ssh.index("-l") + 1] == "serve" and ssh[-2] == "10.0.0.2"
    )
    assert shlex.split(ssh[-1]) == ["bash", "-c", "echo hi"]
    assert wrap(Via.SSH, cluster, ws, "x")[1] == "-T"
    srun = wrap(Via.SLURM, cluster, ws, "echo hi", name="pdcluster-r8")
    assert srun[:2] == ["srun", "--nodes=1"] and "--nodelist=ws" in srun and "--overlap" in srun
    assert "--job-name=pdcluster-r8" in srun and srun[-3:] == ["bash", "-c", "echo hi"]
    assert wrap(Via.LOCAL, cluster, ws, "echo hi") == ["bash", "-c", "echo hi"]


def test_probe_stage_and_router_commands(mixed: tuple[ClusterFile, list[Placement]]) -> None:
    cluster, placed = mixed
    c = commands(cluster)
    probe = shlex.split(c.probe_script(cluster.nodes[0]).splitlines()[1])
    assert probe[1:4] == ["/venv/bin/pdcluster", "devices", "--json"]
    assert probe[probe.index("--ports") + 1] == "32" and probe[probe.index("--bind") + 1] == "192.168.0.1"
    assert probe[probe.index("--check-model") + 1] == "/models/m"
    args = router_args(cluster, placed)
    assert args[args.index("--replica") + 1] == "10.0.0.1:7000" and args[-2:] == ["--admin-token", "t"]
    assert args[args.index("--role") + 9 : args.index("--role") + 12] == ["decode", "decode", "inactive"]


def test_stage_then_stop_script_ends_only_this_runs_processes(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", MIXED)
    c = Commands(cluster, f"unit{os.getpid()}", ("true",), PurePosixPath("/"))
    assert (
        subprocess.run(
            ["bash", "-c", c.stage_script()], input=bundle({"ranks.json": b'{"ranks": []}'}), text=True,
            timeout=10, check=False
        ).returncode
        == 0
    )
    folder = Path(str(c.node_dir))
    assert (folder / "ranks.json").read_text() == '{"ranks": []}'
    ours = subprocess.Popen(["bash", "-c", f"exec -a 'replica {c.run_id}' sleep 60"])
    stranger = subprocess.Popen(["sleep", "60"])  # its pid in a pid file, but not this run's command line
    try:
        (folder / "replica-0-prefill.pid").write_text(f"{ours.pid}\n")
        (folder / "replica-1-decode.pid").write_text(f"{stranger.pid}\n")
        time.sleep(0.2)  # let bash exec
        done = subprocess.run(
            ["bash", "-c", c.stop_script(grace_s=2)], capture_output=True, text=True, timeout=20, check=False
        )
        assert done.returncode == 0 and done.stdout.split() == ["stopped:", str(ours.pid), "killed:"]
        assert ours.wait(5) == -15 and stranger.poll() is None and not folder.exists()
        assert (
            subprocess.run(["bash", "-c", c.stop_script()], timeout=10, check=False).returncode == 0
        )  # again
    finally:
        for proc in (ours, stranger):
            proc.kill()
            proc.wait(5)


def test_a_recorded_h100_vm_node_gets_its_gpu_and_nic_and_no_rdma(tmp_path: Path) -> None:
    """Placement on the inventory recorded on a real single-H100 VM: the replica is cuda:0 with the
    virtio NIC; nccl is accepted there, rdma refused (no RDMA device), naming the node."""
    text = '[model]\npath = "/m"\n[launch]\nfabric = "FABRIC"\n'
    text += '[[nodes]]\nname = "h100"\naddress = "10.0.0.9"\nrole = "decode"\n'
    vm = assemble(
        "h100",
        Sysfs(sysfs_tree.h100_vm(tmp_path)),
        parse_query((RECORDED / "nvidia-smi-h100x1-vm.csv").read_text()),
        "nvidia-smi",
        range(16),
        {"eth0": ("10.0.0.9",)},
    )
    found = {0: Inventory("h100", vm.gpus, vm.nics, vm.cpus, vm.gpu_source, (7000, 7001), "eth0")}
    (placed,) = place(parse(tmp_path / "c.toml", text.replace("FABRIC", "nccl")), found)
    got = (placed.device, placed.cuda_visible_devices, placed.nic, placed.numa_node)
    assert got == ("cuda:0", "0", "eth0", None)
    with pytest.raises(ClusterFileError, match="rdma needs an RDMA NIC, but discovery found none on h100"):
        place(parse(tmp_path / "c.toml", text.replace("FABRIC", "rdma")), found)
