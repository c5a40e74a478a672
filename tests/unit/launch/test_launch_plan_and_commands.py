"""`pdcluster launch` planning: hosts files, slot assignment, the rank table and the ssh/srun commands."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from pdcluster.cluster.launch import Launch, LaunchConfig, pdcluster_command
from pdcluster.cluster.launch_plan import (
    Node,
    Transport,
    assign,
    parse_hosts,
    rank_table,
    remote_script,
    wrap,
)
from transfer.ranktable import parse_rank_table

HOSTS = """
# the cluster
node-a slots=2 transfer_host=10.0.0.1   # IB address
node-b
node-c slots=3
"""


def test_hosts_file_parsing_with_comments_and_options() -> None:
    assert parse_hosts(HOSTS) == [Node("node-a", 2, "10.0.0.1"), Node("node-b", 1, ""), Node("node-c", 3, "")]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "a slots=0", "a slot=2", "a transfer_host=",
                                  "a x"])
def test_bad_hosts_files_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hosts(text)


def test_round_robin_by_slots_and_per_node_ports() -> None:
    nodes = parse_hosts(HOSTS)
    placed = assign(["prefill"] * 2 + ["decode"] * 3 + ["inactive"], nodes, 50051, 7100)
    assert [(p.rank, p.node.host, p.port, p.transfer_port) for p in placed] == [
        (0, "node-a", 50051, 7100), (1, "node-b", 50051, 7100), (2, "node-c", 50051, 7100),
        (3, "node-a", 50052, 7101), (4, "node-c", 50052, 7101), (5, "node-c", 50053, 7102)]
    assert [p.role for p in placed] == ["prefill", "prefill", "decode", "decode", "decode", "inactive"]
    with pytest.raises(ValueError, match="slots"):
        assign(["decode"] * 7, nodes, 50051, 7100)


def test_rank_table_uses_transfer_host_and_round_trips() -> None:
    placed = assign(["prefill", "decode", "decode"], parse_hosts(HOSTS), 6000, 7000)
    table = parse_rank_table(rank_table(placed).to_json())
    assert [(e.rank, e.host, e.node, e.transfer_address, e.grpc_port) for e in table] == [
        (0, "node-a", "node-a", "10.0.0.1:7000", 6000), (1, "node-b", "node-b", "node-b:7000", 6000),
        (2, "node-c", "node-c", "node-c:7000", 6000)]


def test_remote_script_writes_the_table_then_execs_the_replica(tmp_path: Path) -> None:
    table = '{"ranks": []}'
    ranks = tmp_path / "run" / "ranks-r0.json"
    log = tmp_path / "logs" / "replica-0.log"
    script = remote_script(["sh", "-c", 'echo "$0 $1"; echo oops >&2'], ["replica", "0"], tmp_path, ranks,
                           table, log)
    out = subprocess.run(wrap(Transport.LOCAL, "ignored", script, 0), capture_output=True, text=True,
                         timeout=10)
    assert (out.stdout, out.stderr) == ("replica 0\n", "")
    assert ranks.read_text() == table + "\n"
    assert log.read_text() == "oops\n"


def test_ssh_and_srun_wrappers() -> None:
    script = "cd /x\nexec pdcluster replica"
    ssh = wrap(Transport.SSH, "node-a", script, 3)
    assert ssh[:5] == ["ssh", "-tt", "-o", "BatchMode=yes", "node-a"]
    assert shlex.split(ssh[5]) == ["bash", "-c", script]
    srun = wrap(Transport.SRUN, "node-b", script, 3)
    assert srun[0] == "srun" and "--nodelist=node-b" in srun and "--ntasks=1" in srun
    assert srun[-3:] == ["bash", "-c", script]


def _launch(tmp_path: Path, **overrides: object) -> Launch:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    config = LaunchConfig(model=Path("/models/m"), hosts=hosts, prefill=1, decode=2,
                          python="/venv/bin/pdcluster", workdir=Path("/srv/pd"), **overrides)  # type: ignore[arg-type]
    return Launch(config, parse_hosts(hosts.read_text()))


def test_replica_command_carries_rank_cluster_fabric_host_port(tmp_path: Path) -> None:
    launch = _launch(tmp_path, transport="srun", inactive=1)
    argv = launch.replica_argv(launch.placements[3])
    script = argv[-1]
    assert argv[:1] == ["srun"] and "--nodelist=node-b" in argv
    command = shlex.split(script.splitlines()[-1])
    assert command.pop().startswith("2>>/tmp/")
    assert command[:3] == ["exec", "/venv/bin/pdcluster", "replica"]
    for flag, value in [("--rank", "3"), ("--fabric", "tcp"), ("--host", "node-b"), ("--port", "50052"),
                        ("--model", "/models/m")]:
        assert command[command.index(flag) + 1] == value
    assert "--inactive" in command
    table = script.split("<<'PDCLUSTER_RANKS'\n", 1)[1].split("\nPDCLUSTER_RANKS", 1)[0]
    assert [e["rank"] for e in json.loads(table)["ranks"]] == [0, 1, 2, 3]
    assert command[command.index("--cluster") + 1].endswith("ranks-r3.json")


def test_shared_dir_sends_no_inline_table_and_dry_run_lists_everything(tmp_path: Path) -> None:
    launch = _launch(tmp_path, shared_dir=tmp_path / "shared")
    script = launch.replica_argv(launch.placements[0])[-1]
    assert "PDCLUSTER_RANKS" not in shlex.split(script)[-1]
    text = launch.dry_run()
    assert text.count("# rank ") == 4 and "--replica node-a:50051 node-b:50051 node-a:50052" in text
    assert "--role prefill decode decode" in text
    assert not (tmp_path / "shared").exists() and not launch.log_dir.exists()


def test_config_needs_exactly_one_node_source_and_default_command(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LaunchConfig(model=Path("m"))
    with pytest.raises(ValueError):
        LaunchConfig(model=Path("m"), hosts=tmp_path, slurm=True)
    assert pdcluster_command("python -m pdcluster") == ["python", "-m", "pdcluster"]
    assert pdcluster_command("")[0].endswith(("pdcluster", "python", "python3"))
