"""`pdcluster launch` and the fabric: the cluster file takes `cuda-ipc` and `auto` (cuda-ipc: one node,
CUDA devices only); on cuda-ipc and auto a node's replicas all see its devices in use and pick theirs
with `--device cuda:K`; for nccl, rdma and auto the launch serves the rendezvous store and names it in
the rank table it stages, and a replica's restart re-joins that same store."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

import pdcluster.cluster.launch
from pdcluster.cluster.clusterfile import ClusterFileError, Fabric, parse
from pdcluster.cluster.launch import Launch, LaunchConfig, load, store_host
from pdcluster.cluster.launch_plan import place, ports_wanted
from pdcluster.cluster.remote import Answer
from pdcluster.discovery.discover import assemble
from pdcluster.discovery.inventory import Inventory
from pdcluster.discovery.nvidia import parse_query
from pdcluster.discovery.sysfs import Sysfs
from tests.helpers import sysfs_tree
from tests.unit.launch.test_launch_devices import commands, flag, replica_argv
from tests.unit.launch.test_launch_plan import MIXED, RECORDED, inventories
from transfer.core import Deadline
from transfer.ranktable import parse_rank_table
from transfer.store import StoreRendezvous, connect_store

ONE_NODE = """\
[model]
path = "/models/m"
[launch]
fabric = "cuda-ipc"
[[nodes]]
name = "dgx"
address = "10.0.0.1"
devices = [2, 5, 7]
prefill = 1
decode = 2
"""


def dgx_inventory(tmp_path: Path, cluster: Any) -> dict[int, Inventory]:
    smi = parse_query((RECORDED / "nvidia-smi-h100x8.csv").read_text())
    inv = assemble("dgx", Sysfs(sysfs_tree.dgx_h100(tmp_path / "dgx")), smi, "nvidia-smi", range(224), {})
    node = cluster.nodes[0]
    return {0: Inventory(inv.hostname, inv.gpus, inv.nics, inv.cpus, inv.gpu_source,
                         tuple(range(7000, 7000 + ports_wanted(node))), inv.transfer_nic)}


@pytest.mark.parametrize("fabric", ["cuda-ipc", "auto"])
def test_replicas_of_a_node_share_its_devices_on_cuda_ipc_and_auto(tmp_path: Path, fabric: str) -> None:
    cluster = parse(tmp_path / "c.toml", ONE_NODE.replace('"cuda-ipc"', f'"{fabric}"'))
    assert cluster.launch.fabric is Fabric(fabric)
    placed = place(cluster, dgx_inventory(tmp_path, cluster))
    assert [p.device for p in placed] == ["cuda:2", "cuda:5", "cuda:7"]  # the rank table: the node's indices
    c = commands(cluster)
    for k, p in enumerate(placed):
        assert "CUDA_VISIBLE_DEVICES=2,5,7" in c.replica_script(p)
        argv = replica_argv(c, p)
        assert (flag(argv, "--device"), flag(argv, "--fabric")) == (f"cuda:{k}", fabric)


def test_tcp_and_nccl_keep_one_device_per_replica(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", ONE_NODE.replace('"cuda-ipc"', '"nccl"'))
    placed = place(cluster, dgx_inventory(tmp_path, cluster))
    c = commands(cluster)
    assert "CUDA_VISIBLE_DEVICES=5\n" in c.replica_script(placed[1])
    assert flag(replica_argv(c, placed[1]), "--device") == "cuda"


def test_cuda_ipc_needs_one_node_and_cuda_devices(tmp_path: Path) -> None:
    with pytest.raises(ClusterFileError, match=r"c.toml:6: fabric cuda-ipc joins replicas on one host, but "
                                               r"the file has 3 nodes \(use nccl, rdma or auto\)"):
        parse(tmp_path / "c.toml", MIXED.replace('fabric = "tcp"', 'fabric = "cuda-ipc"'))
    cpu_node = ONE_NODE.replace("devices = [2, 5, 7]", 'devices = "cpu"\ncpu_replicas = 3')
    with pytest.raises(ClusterFileError, match='needs CUDA devices but dgx has devices = "cpu"'):
        parse(tmp_path / "c.toml", cpu_node)
    cpu_launch = cpu_node.replace('fabric = "cuda-ipc"', 'fabric = "cuda-ipc"\ndevice = "cpu"')
    with pytest.raises(ClusterFileError, match=r"fabric cuda-ipc needs CUDA devices but the launch's device"):
        parse(tmp_path / "c.toml", cpu_launch)


def test_the_command_line_takes_every_fabric(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text(MIXED)
    assert load(LaunchConfig(file, fabric="auto"))[0].launch.fabric is Fabric.AUTO
    with pytest.raises(ClusterFileError, match="cuda-ipc joins replicas on one host"):
        load(LaunchConfig(file, fabric="cuda-ipc"))


def _staged_tables(launch: Launch, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Run `launch.stage` with every node's session faked; the rank tables each node was sent."""
    sent: list[dict[str, Any]] = []

    def fake_fan_out(nodes: list[Any], script_of: Any, timeout: float, stdin_of: Any = None) -> list[Answer]:
        for node in nodes if stdin_of is not None else ():  # stop's sessions read no stdin
            with tarfile.open(fileobj=io.BytesIO(base64.b64decode(stdin_of(node)))) as tar:
                member = tar.extractfile("ranks.json")
                assert member is not None
                sent.append(json.loads(member.read()))
        return [Answer(n, 0, "", "", 0.1) for n in nodes]

    monkeypatch.setattr(launch, "_fan_out", fake_fan_out)
    launch.stage(1e12)
    return sent


@pytest.mark.parametrize("fabric", ["tcp", "auto"])
def test_the_staged_rank_table_names_the_store_this_launch_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fabric: str,
) -> None:
    monkeypatch.setattr(pdcluster.cluster.launch, "store_host", lambda towards: "127.0.0.1")
    file = tmp_path / "c.toml"
    file.write_text(MIXED.replace('[launch]\n', f'[launch]\nlog_dir = "{tmp_path / "logs"}"\n'))
    cluster, via = load(LaunchConfig(file, fabric=fabric))
    launch = Launch(cluster, via, run_id="RUN1")
    launch.plan(inventories(tmp_path, cluster))
    tables = _staged_tables(launch, monkeypatch)
    assert len(tables) == 3 and all(t == tables[0] for t in tables)  # one table, every node
    table = parse_rank_table(json.dumps(tables[0]))
    if fabric == "tcp":
        assert table.store == "" and launch.store is None
        return
    assert table.store == launch.store_address and table.store.startswith("127.0.0.1:")
    # replica 1 starts, publishes, is restarted: the same store, its next incarnation, nothing lost
    first = StoreRendezvous(connect_store(table.store, timeout_s=5), rank=1)
    first.publish("uid", b"life-1")
    again = StoreRendezvous(connect_store(table.store, timeout_s=5), rank=1)
    assert (first.incarnation, again.incarnation) == (1, 2)
    assert again.lookup("uid", Deadline.after(5)) == b"life-1"
    assert _staged_tables(launch, monkeypatch)[0]["store"] == table.store  # served once per launch
    launch.stop()
    assert launch.store is None


def test_dry_run_says_where_the_store_will_be(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.toml"
    file.write_text(MIXED)
    cluster, via = load(LaunchConfig(file, fabric="auto"))
    launch = Launch(cluster, via, run_id="RUN1")
    monkeypatch.setattr(launch, "discover", lambda deadline: inventories(tmp_path, cluster))
    monkeypatch.setattr(pdcluster.cluster.launch, "store_host", lambda towards: "10.0.0.254")
    text = launch.dry_run()
    assert "# rendezvous store: served by this process at start on 10.0.0.254:<a free port>" in text
    assert launch.store is None  # a dry run serves nothing
    assert text.count("--fabric auto") == 11  # every replica's command


def test_store_host_is_this_machines_address_towards_the_node() -> None:
    assert store_host("127.0.0.1") == "127.0.0.1"


def test_status_shows_the_fabric_and_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from pdcluster.cluster.runstate import RunFile, RunPhase
    from pdcluster.cluster.status import StatusConfig, run_status

    monkeypatch.setattr(pdcluster.cluster.launch, "store_host", lambda towards: "127.0.0.1")
    file = tmp_path / "c.toml"
    file.write_text(MIXED.replace('[launch]\n', f'[launch]\nlog_dir = "{tmp_path / "logs"}"\n'))
    cluster, via = load(LaunchConfig(file, fabric="auto"))
    launch = Launch(cluster, via, run_id="RUN1")
    launch.plan(inventories(tmp_path, cluster))
    _staged_tables(launch, monkeypatch)
    record = launch.record(RunPhase.READY)
    assert (record.fabric, record.store) == ("auto", launch.store_address)
    RunFile(cluster.launch.log_dir).write(record.with_(replicas=()))  # no replica to health-check
    run_status(StatusConfig(file, timeout=0.2))
    assert f"fabric: auto (rendezvous store {launch.store_address})" in capsys.readouterr().out
