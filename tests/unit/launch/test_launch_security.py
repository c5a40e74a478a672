"""`[tls]` and `[cluster] token_file` of a cluster file: every replica's command line carries its own
node's staged certificate, key, CA and token file; the router its own certificate and the token file;
each node receives only its own key; what is missing or unusable is refused naming its line before
anything starts; the stage script unpacks the files owner-only."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from pdcluster.cluster.clusterfile import ClusterFile, ClusterFileError, parse
from pdcluster.cluster.launch_plan import Commands, Placement, place, router_args
from pdcluster.cluster.security import bundle
from pdcluster.discovery.inventory import Cpus, Inventory
from pdcluster.tools.certs import MakeCertsConfig, make_certs

HOSTS = ["10.0.0.1", "10.0.0.2", "router.example"]

FILE = """\
[model]
path = "/models/m"

[router]
host = "0.0.0.0"
http_port = 0

[tls]
certs = "certs"
router_name = "router.example"
mutual = true

[cluster]
token_file = "token"

[[nodes]]
name = "a"
address = "10.0.0.1"
devices = "cpu"
prefill = 1

[[nodes]]
name = "b"
address = "10.0.0.2"
devices = "cpu"
cpu_replicas = 2
decode = 2
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    make_certs(MakeCertsConfig(out=tmp_path / "certs", host=HOSTS, client=["client"]))
    (tmp_path / "token").write_text("s3cret\n")
    return tmp_path


def parsed(folder: Path, text: str = FILE) -> ClusterFile:
    path = folder / "cluster.toml"
    path.write_text(text)
    return parse(path)


def placed(cluster: ClusterFile) -> list[Placement]:
    inventories = {
        n.index: Inventory(
            n.name, (), (), Cpus((0, 1, 2, 3), {}), ports=tuple(range(7000, 7008)), transfer_nic="eth0"
        )
        for n in cluster.nodes
    }
    return place(cluster, inventories)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_replica_gets_its_own_nodes_staged_files_and_the_token_file(folder: Path) -> None:
    cluster = parsed(folder)
    commands = Commands(cluster, "RUN1", ("pdcluster",), PurePosixPath("/srv"))
    run = "/tmp/pdcluster-RUN1"
    for p in placed(cluster):
        argv = shlex.split(commands.replica_script(p).splitlines()[-1])
        host = p.node.address
        assert (
            flag(argv, "--tls-cert") == f"{run}/{host}.crt" and flag(argv, "--tls-key") == f"{run}/{host}.key"
        )
        assert flag(argv, "--tls-ca") == f"{run}/ca.crt" and flag(argv, "--tls-client-ca") == f"{run}/ca.crt"
        assert flag(argv, "--cluster-token-file") == f"{run}/cluster-token"
        assert "--cluster-token" not in argv and "s3cret" not in " ".join(argv)
    certs = folder / "certs"
    for node in cluster.nodes:
        staged = commands.staged_files(node)
        assert staged == {
            "ca.crt": certs / "ca.crt",
            f"{node.address}.crt": certs / f"{node.address}.crt",
            f"{node.address}.key": certs / f"{node.address}.key",
            "cluster-token": folder / "token",
        }


def test_the_router_gets_its_certificate_and_the_token_file(folder: Path) -> None:
    cluster = parsed(folder)
    args = router_args(cluster, placed(cluster))
    certs = folder / "certs"
    assert flag(args, "--tls-cert") == str(certs / "router.example.crt")
    assert flag(args, "--tls-key") == str(certs / "router.example.key")
    assert flag(args, "--tls-ca") == str(certs / "ca.crt") and flag(args, "--tls-client-ca") == str(
        certs / "ca.crt"
    )
    assert flag(args, "--cluster-token-file") == str(folder / "token")


def test_without_mutual_no_client_ca_and_without_sections_no_flags(folder: Path) -> None:
    one_way = parsed(folder, FILE.replace("mutual = true", "mutual = false"))
    argv = shlex.split(
        Commands(one_way, "R", ("pdcluster",), PurePosixPath("/"))
        .replica_script(placed(one_way)[0])
        .splitlines()[-1]
    )
    assert "--tls-cert" in argv and "--tls-client-ca" not in argv
    assert "--tls-client-ca" not in router_args(one_way, placed(one_way))
    plain_text = FILE.split("[tls]")[0] + FILE[FILE.index("[[nodes]]") :]
    plain = parsed(folder, plain_text.replace('host = "0.0.0.0"', 'host = "127.0.0.1"'))
    commands = Commands(plain, "R", ("pdcluster",), PurePosixPath("/"))
    assert commands.staged_files(plain.nodes[0]) == {}
    script = commands.replica_script(placed(plain)[0]) + " ".join(router_args(plain, placed(plain)))
    assert "--tls" not in script and "--cluster-token" not in script


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    ("change", "needle", "message"),
    [
        (lambda f: (f / "certs" / "ca.crt").unlink(), 'certs = "certs"', "no ca.crt in"),
        (
            lambda f: (f / "certs" / "10.0.0.2.key").unlink(),
            'address = "10.0.0.2"',
            "nodes[1] (10.0.0.2) needs",
        ),
        (
            lambda f: (f / "certs" / "router.example.crt").unlink(),
            "router_name =",
            "the router (router.example)",
        ),
        (lambda f: (f / "certs" / "client.key").unlink(), "[tls]", "--client client"),
        (lambda f: (f / "token").unlink(), "token_file =", "No such file"),
        (lambda f: (f / "token").write_text("\n"), "token_file =", "is empty"),
        (lambda f: (f / "token").write_text("two words\n"), "token_file =", "printable ASCII without spaces"),
    ],
)
def test_a_missing_or_unusable_file_is_refused_naming_its_line(
    folder: Path, change, needle: str, message: str
) -> None:
    change(folder)
    with pytest.raises(ClusterFileError) as error:
        parsed(folder)
    assert str(error.value).startswith(f"{folder / 'cluster.toml'}:{_line(FILE, needle)}: "), str(error.value)
    assert message in str(error.value)
    parse(folder / "cluster.toml", files=False)  # `pdcluster down` still reads it


@pytest.mark.parametrize(
    ("old", "new", "needle", "message"),
    [
        ('router_name = "router.example"\n', "", 'host = "0.0.0.0"', "tls.router_name ="),
        ('certs = "certs"', 'certs = "nowhere"', 'certs = "nowhere"', "no folder"),
        ('certs = "certs"', 'cert = "certs"', 'cert = "certs"', "unknown key 'tls.cert'"),
        ("mutual = true", 'mutual = "yes"', "mutual =", "tls.mutual must be bool"),
        ('certs = "certs"\n', "", "[tls]", "[tls] needs certs ="),
        ('token_file = "token"', 'token = "x"', "token = ", "unknown key 'cluster.token'"),
        ("http_port = 0", 'http_port = 0\nflags = { tls-cert = "x.crt" }', "flags =", "set by the launch"),
        (
            "http_port = 0",
            'http_port = 0\n[launch]\nreplica_flags = { cluster-token = "t" }',
            "replica_flags",
            "set by the launch",
        ),
    ],
)
def test_bad_tls_and_token_keys_are_refused_naming_their_line(
    folder: Path, old: str, new: str, needle: str, message: str
) -> None:
    text = FILE.replace(old, new, 1)
    assert text != FILE
    with pytest.raises(ClusterFileError) as error:
        parsed(folder, text)
    assert str(error.value).startswith(f"{folder / 'cluster.toml'}:{_line(text, needle)}: "), str(error.value)
    assert message in str(error.value)


def test_the_stage_script_unpacks_every_file_owner_only(folder: Path) -> None:
    cluster = parsed(folder)
    commands = Commands(cluster, f"unit-tls{os.getpid()}", ("true",), PurePosixPath("/"))
    node = cluster.nodes[1]
    files = {
        "ranks.json": b'{"ranks": []}',
        **{n: p.read_bytes() for n, p in commands.staged_files(node).items()},
    }
    done = subprocess.run(
        ["bash", "-c", commands.stage_script()],
        input=bundle(files),
        text=True,
        capture_output=True,
        timeout=10,
        check=False,
    )
    there = Path(str(commands.node_dir))
    try:
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in there.iterdir()) == sorted(files)  # and no temporary folder left
        for name, data in files.items():
            assert (there / name).read_bytes() == data and stat.S_IMODE(
                (there / name).stat().st_mode
            ) == 0o600
        assert stat.S_IMODE(there.stat().st_mode) == 0o700
    finally:
        subprocess.run(["rm", "-rf", str(there)], check=False)
