"""`tp` in the cluster file and `pdcluster launch`: a replica's tensor-parallel group placed on
consecutive CUDA devices of one node (or slices of one CPU worker's cores), one rank-table entry per
tp_rank, `--tp N` on its command line, and groups that do not fit refused naming the line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest

from pdcluster.cluster.clusterfile import ClusterFile, ClusterFileError, parse
from pdcluster.cluster.launch import LaunchConfig, load
from pdcluster.cluster.launch_plan import Commands, place, ports_wanted, rank_table
from pdcluster.discovery.inventory import Inventory
from tests.unit.launch import test_launch_plan
from tests.unit.launch.test_launch_plan import MIXED
from transfer.ranktable import parse_rank_table


def inventories(tmp_path: Path, cluster: ClusterFile) -> dict[int, Inventory]:
    """The mixed nodes' inventories, each with the ports its tp groups need drawn."""
    found = test_launch_plan.inventories(tmp_path, cluster)
    return {i: dataclasses.replace(inv, ports=tuple(range(7000 + 100 * i, 7000 + 100 * i + ports_wanted(
        cluster.nodes[i], cluster.tp_of(cluster.nodes[i]))))) for i, inv in found.items()}


def tp_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_groups_take_consecutive_devices_and_one_rank_each(tmp_path: Path) -> None:
    text = MIXED.replace('fabric = "tcp"', 'fabric = "tcp"\ntp = 2')
    text = text.replace("decode = 1\nenv", "tp = 1\ndecode = 1\nenv")
    cluster = parse(tmp_path / "c.toml", text)
    placed = place(cluster, inventories(tmp_path, cluster))
    dgx = placed[:4]
    assert [(p.rank, p.tp, p.group_ordinals, p.cuda_visible_devices) for p in dgx] == [
        (2 * i, 2, (2 * i, 2 * i + 1), f"{2 * i},{2 * i + 1}") for i in range(4)
    ]
    assert [(p.port, p.transfer_port, p.group_ports) for p in dgx[:2]] == [(7000, 7001, (7002,)),
                                                                           (7003, 7004, (7005,))]
    ws, cpu = placed[4], placed[5:]
    assert (ws.rank, ws.tp, ws.device_label) == (8, 1, "cuda:0")  # its own tp = 1
    assert [(p.rank, p.tp, p.device_label, p.engine_cpus) for p in cpu] == [
        (9, 2, "cpu/2", (0, 1)), (11, 2, "cpu/2", (2, 3))]
    table = parse_rank_table(rank_table(placed).to_json())
    assert len(table) == 13 and table.ranks == tuple(range(13))
    assert [(e.device, e.grpc_port, e.transfer_address) for e in (table[0], table[1])] == [
        ("cuda:0", 7000, "192.168.0.1:7001"), ("cuda:1", 0, "192.168.0.1:7002")]
    assert (table[10].device, table[10].grpc_port, table[10].transfer_address) == ("cpu", 0, "10.0.0.3:7202")
    assert [table[r].tp_group for r in (0, 1, 2, 3, 8, 9, 10)] == [None, 0, None, 2, None, None, 9]
    commands = Commands(cluster, "run1", ("pdcluster",), PurePosixPath("/w"))
    args = commands.replica_args(dgx[1])
    assert args[args.index("--rank") + 1] == "2" and args[args.index("--tp") + 1] == "2"
    assert args[args.index("--device") + 1] == "cuda"  # rank r on the visible cuda:r
    assert "--tp" not in commands.replica_args(ws)
    assert ports_wanted(cluster.nodes[0], 2) == 3 * 16


def test_shared_devices_keep_a_group_adjacent(tmp_path: Path) -> None:
    text = MIXED.replace('fabric = "tcp"', 'fabric = "auto"\ntp = 2')
    text = text.replace('role = "prefill"', "prefill = 2")
    text = text.replace("devices = [0]", "tp = 1\ndevices = [0]")
    cluster = parse(tmp_path / "c.toml", text)
    dgx = place(cluster, inventories(tmp_path, cluster))[:2]
    assert [p.cuda_visible_devices for p in dgx] == ["0,1,2,3", "0,1,2,3"]
    assert [p.torch_device for p in dgx] == ["cuda:0", "cuda:2"]


def test_groups_that_do_not_fit_are_refused_naming_the_line(tmp_path: Path) -> None:
    listed = MIXED.replace("devices = [0]", "devices = [0]\ntp = 2")
    with pytest.raises(ClusterFileError, match=r"c.toml:21: ws asks for 1 replica\(s\) of tp 2 \(2 CUDA "
                                               r"devices, a group's ranks on one node\) but lists 1"):
        parse(tmp_path / "c.toml", listed)
    cluster = parse(tmp_path / "c.toml", MIXED.replace('role = "prefill"', 'role = "prefill"\ntp = 16'))
    with pytest.raises(ClusterFileError, match=r"c.toml:15: dgx asks for 1 replica\(s\) of tp 16 \(16 CUDA "
                                               r"devices, a group's ranks on one node\) but has 8"):
        place(cluster, inventories(tmp_path, cluster))
    cluster = parse(tmp_path / "c.toml", MIXED.replace("cpu_replicas = 2", "cpu_replicas = 2\ntp = 3"))
    with pytest.raises(ClusterFileError, match=r"c.toml:28: cpu: a replica of tp 3 needs a core per rank, "
                                               r"but each of its 2 CPU worker\(s\) has 2"):
        place(cluster, inventories(tmp_path / "2", cluster))
    with pytest.raises(ClusterFileError, match=r"'tp' is set by the launch"):
        flags = 'fabric = "tcp"\nreplica_flags = { tp = 2 }'
        parse(tmp_path / "c.toml", MIXED.replace('fabric = "tcp"', flags))
    with pytest.raises(ClusterFileError, match=r"tp must be >= 1, not 0"):
        parse(tmp_path / "c.toml", MIXED.replace('fabric = "tcp"', 'fabric = "tcp"\ntp = 0'))


def test_the_command_line_tp_overrides_the_launch_default(tmp_path: Path) -> None:
    path = tp_file(tmp_path, MIXED.replace("devices = [0]", "devices = [0]\ntp = 1"))
    cluster, _ = load(LaunchConfig(path, tp=4))
    assert (cluster.launch.tp, cluster.tp_of(cluster.nodes[0]), cluster.tp_of(cluster.nodes[1])) == (4, 4, 1)
    with pytest.raises(ClusterFileError, match="cpu: a replica of tp 4 needs a core per rank"):
        place(cluster, inventories(tmp_path, cluster))
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        LaunchConfig(path, tp=-1)


def test_a_tp_that_does_not_cut_the_checkpoint_is_refused_before_any_node_is_reached(
    tmp_path: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    text = MIXED.replace('path = "/models/m"', f'path = "{tiny_model_factory()}"')
    path = tp_file(tmp_path, text.replace("devices = [0]", "devices = [0]\ntp = 1"))
    load(LaunchConfig(path, tp=2))  # 4 heads, 2 KV heads: cut in two
    with pytest.raises(ClusterFileError, match=r"c.toml:\d+: tp 3 on dgx: tensor parallel degree 3 does "
                                               r"not divide num_attention_heads=4"):
        load(LaunchConfig(path, tp=3))
