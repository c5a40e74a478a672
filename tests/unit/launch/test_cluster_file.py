"""The cluster file: the README's example parses; every refusal names the line of the value at fault."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdcluster.cli.main import parse as parse_command
from pdcluster.cluster.clusterfile import ClusterFileError, DeviceMode, Fabric, Via, parse
from pdcluster.cluster.extra_flags import flag_args, parse_flags
from pdcluster.cluster.launch_plan import router_args
from pdcluster.cluster.toml_lines import line_of, locate
from replica.config import ReplicaConfig
from router.config import RouterConfig

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
    cluster = parse(Path("/etc/pd/cluster.toml"), readme_example(), files=False)  # no certs/ here
    assert cluster.model.path == Path("/shared/models/llama-7b") and cluster.model.root == Path(
        "/shared/models"
    )
    assert (cluster.router.host, cluster.router.http_port, cluster.router.strategy) == (
        "0.0.0.0",
        8080,
        "full",
    )
    assert cluster.router.scaling == "static"
    assert flag_args(cluster.router.flags) == ["--heartbeat-timeout", "30"]
    assert flag_args(cluster.launch.replica_flags) == ["--max-input-tokens", "4096"]
    sec = cluster.security
    assert (sec.certs, sec.mutual) == (Path("/etc/pd/certs"), True)
    assert (sec.router_name, sec.client) == ("router.example", "client")
    assert sec.token_file == Path("/etc/pd/cluster-token")
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
        (("http_port = 0", 'http_port = 0\nstrategy = "fast"'), 6, "unknown migration strategy 'fast'"),
        (("http_port = 0", 'http_port = 0\nscaling = "more"'), 6, "unknown scaling policy 'more'"),
        (("http_port = 0", "http_port = 0\nflags = { colour = 1 }"), 6, "'colour' is not a flag"),
        (("http_port = 0", 'http_port = 0\nflags = { replica = "x:1" }'), 6, "is set by the launch"),
        (("http_port = 0", "http_port = 0\nflags = { timeline = { a = 1 } }"), 6, "takes a string"),
        (("http_port = 0", "http_port = 0\n[launch]\nreplica_flags = { rank = 2 }"), 7, "set by the launch"),
    ],
)
def test_refusals_name_the_line(change: tuple[str, str], line: int, message: str) -> None:
    text = BASE.replace(*change, 1)
    assert text != BASE
    with pytest.raises(ClusterFileError) as error:
        parse(Path("c.toml"), text)
    assert str(error.value).startswith(f"c.toml:{line}: "), str(error.value)
    assert message in str(error.value)


def test_more_router_and_replica_flags_reach_the_commands() -> None:
    text = BASE.replace("http_port = 0", """http_port = 0
strategy = "recompute"
scaling = "live"
flags = { heartbeat-timeout = 30, min-prefill = 1, timeline = "/tmp/t.jsonl" }
[launch]
replica_flags = { host-cache = true, grpc-frontend = false, disk-gbps = 16.5 }""")
    cluster = parse(Path("c.toml"), text)
    args = router_args(cluster, [])
    assert args[args.index("--strategy") : args.index("--strategy") + 4] == [
        "--strategy", "recompute", "--scaling", "live"
    ]
    assert args[-6:] == ["--heartbeat-timeout", "30", "--min-prefill", "1", "--timeline", "/tmp/t.jsonl"]
    extra = flag_args(cluster.launch.replica_flags)
    assert extra == ["--host-cache", "--no-grpc-frontend", "--disk-gbps", "16.5"]
    # both commands take them as given
    router = parse_command([*args, "--replica", "127.0.0.1:1", "--role", "decode"])
    assert isinstance(router, RouterConfig)
    assert (router.heartbeat_timeout, router.min_prefill, router.scaling) == (30.0, 1, "live")
    replica = parse_command(["replica", "--model", "/m", "--port", "0", *extra])
    assert isinstance(replica, ReplicaConfig)
    assert (replica.host_cache, replica.grpc_frontend, replica.disk_gbps) == (True, False, 16.5)


def test_a_list_repeats_the_values_after_one_flag() -> None:
    text = BASE.replace("http_port = 0", 'http_port = 0\nflags = { replica = 1 }')
    with pytest.raises(ClusterFileError, match="set by the launch"):
        parse(Path("c.toml"), text)
    flags = parse_flags({"engine-cpus": [2, 3]}, {"engine_cpus"}, frozenset(), lambda n, m: ValueError(m))
    assert flag_args(flags) == ["--engine-cpus", "2", "3"]


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
