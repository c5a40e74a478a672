"""The cluster file: the README's example parses; every refusal names the line of the value at fault."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdcluster.cluster.clusterfile import ClusterFileError, DeviceMode, Fabric, Via, parse
from pdcluster.cluster.toml_lines import line_of, locate
from router.config import Strategy

README = Path(__file__).resolve().parents[3] / "pdcluster" / "cluster" / "README.md"

BASE = """\
[model]
path = "/models/m"

[router]
http_port = 0

[[nodes]]
name = "a"
address = "10.0.0.1"
devices = [0, 1]
prefill = 1
decode = 1

[[nodes]]
address = "10.0.0.2"
devices = "cpu"
decode = 1
"""


def readme_example() -> str:
    match = re.search(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert match is not None
    return match.group(1)


def test_the_readme_example_parses() -> None:
    cluster = parse(Path("/etc/pd/cluster.toml"), readme_example())
    assert cluster.model.path == Path("/shared/models/llama-7b") and cluster.model.root == Path(
        "/shared/models"
    )
    assert (cluster.router.host, cluster.router.http_port, cluster.router.strategy) == (
        "0.0.0.0",
        8080,
        Strategy.FULL,
    )
    assert cluster.launch.via is Via.SSH and cluster.launch.fabric is Fabric.TCP
    assert cluster.launch.log_dir == Path("/etc/pd/logs") and cluster.ssh.config == Path("/etc/pd/ssh_config")
    a, b, c = cluster.nodes
    assert (a.devices.mode, a.role, a.roles(8)) == (DeviceMode.AUTO, "prefill", ["prefill"] * 8)
    assert a.transfer_host == "192.168.100.11" and a.nic_gbps == 400 and a.ssh_user == "serve"
    assert b.devices.ordinals == (0, 1, 2, 3) and b.roles(4) == ["decode"] * 3 + ["inactive"]
    assert b.env == (("NCCL_SOCKET_IFNAME", "ib0"),)
    assert (c.devices.mode, c.cpu_replicas, c.transfer_host, c.name) == (
        DeviceMode.CPU,
        2,
        "10.0.0.13",
        "cpu-c",
    )


def test_defaults_and_names() -> None:
    cluster = parse(Path("c.toml"), BASE)
    assert cluster.nodes[1].name == "10.0.0.2" and cluster.router.admin_port == 50100
    assert cluster.launch.max_restarts == 3 and cluster.ssh.options == ()


@pytest.mark.parametrize(
    ("change", "line", "message"),
    [
        (("prefill = 1\n", "prefill = 1\ncolour = 2\n"), 12, "unknown key 'nodes[0].colour'"),
        (("[router]\n", "[router]\nport = 1\n"), 5, "unknown key 'router.port'"),
        (('address = "10.0.0.2"', 'address = "10.0.0.1"'), 15, "same address '10.0.0.1' as nodes[0]"),
        (('address = "10.0.0.2"', 'address = "10.0.0.2"\nname = "a"'), 16, "same name 'a'"),
        (("devices = [0, 1]", "devices = [0, 1, 1]"), 10, "lists CUDA device 1 twice"),
        (("decode = 1\n\n", "decode = 2\n\n"), 10, "asks for 3 replicas but has 2 CUDA device(s)"),
        (('devices = "cpu"\ndecode = 1', 'devices = "cpu"\ndecode = 2'), 14, "cpu_replicas = 1"),
        (("http_port = 0", "http_port = 70000"), 5, "must be a port"),
        (("http_port = 0", 'http_port = "80"'), 5, "must be int"),
        (('devices = "cpu"', 'devices = "gpu"'), 16, 'must be "auto", "cpu" or a list'),
        (('devices = "cpu"\ndecode = 1', 'devices = "cpu"\nrole = "decode"\ndecode = 1'), 17, "either role"),
        (('devices = "cpu"\ndecode = 1', 'devices = "cpu"\ndecode = 0'), 14, "runs no replica"),
        (("http_port = 0", 'http_port = 0\n[launch]\nfabric = "nccl"'), 18, "fabric nccl needs CUDA devices"),
        (("http_port = 0", 'http_port = 0\n[launch]\nvia = "pigeon"'), 7, "launch.via must be one of"),
        (('devices = "cpu"\ndecode = 1', 'devices = "cpu"\ndecode = 1\nenv = { "1X" = "y" }'), 18, "env"),
        (("prefill = 1\n", "prefill = 1\ncpu_replicas = 2\n"), 12, "cpu_replicas is for CPU nodes"),
    ],
)
def test_refusals_name_the_line(change: tuple[str, str], line: int, message: str) -> None:
    text = BASE.replace(*change, 1)
    assert text != BASE
    with pytest.raises(ClusterFileError) as error:
        parse(Path("c.toml"), text)
    assert str(error.value).startswith(f"c.toml:{line}: "), str(error.value)
    assert message in str(error.value)


def test_missing_tables_and_bad_toml() -> None:
    with pytest.raises(ClusterFileError, match="no \\[\\[nodes\\]\\] table"):
        parse(Path("c.toml"), '[model]\npath = "m"\n')
    with pytest.raises(ClusterFileError, match="missing \\[model\\]"):
        parse(Path("c.toml"), BASE.replace('[model]\npath = "/models/m"\n', ""))
    with pytest.raises(ClusterFileError, match=r"not valid TOML.*line 2"):
        parse(Path("c.toml"), "[model]\npath = \n")
    with pytest.raises(ClusterFileError, match="cannot read cluster file"):
        parse(Path("/nonexistent/cluster.toml"))


def test_line_locator_follows_tables_arrays_strings_and_comments() -> None:
    text = """# a comment [not a table]
[model]  # trailing
path = "a # not a comment"
[[nodes]]
address = "x"
options = [
  "a = b",   # inside a multi-line array: not a key
]
devices = [0]
[[nodes]]
"quoted.key" = 1
env = { A = "1" }
text = \"\"\"
fake = 1
\"\"\"
after = 2
"""
    lines = locate(text)
    assert lines[("model",)] == 2 and lines[("model", "path")] == 3
    assert (
        lines[("nodes", 0)] == 4
        and lines[("nodes", 0, "options")] == 6
        and lines[("nodes", 0, "devices")] == 9
    )
    assert lines[("nodes", 1, "quoted.key")] == 11 and lines[("nodes", 1, "env")] == 12
    assert ("nodes", 1, "fake") not in lines and lines[("nodes", 1, "after")] == 16
    assert line_of(lines, ("nodes", 1, "missing")) == 10 and line_of(lines, ("nope",)) == 0
