"""`[[models]]` in the cluster file: parsed, mirrored to the router's `--models` (which the router
parses back to the same bounds) and to every replica's `--weight-buffer-models`; every refusal names
the entry's line."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from pdcluster.cluster.clusterfile import ClusterFileError, parse
from pdcluster.cluster.launch_plan import Commands, place, router_args
from pdcluster.discovery.inventory import Cpus, Inventory
from router.models import parse_model

BASE = """\
[model]
path = "/models/alpha"

[[nodes]]
address = "10.0.0.1"
devices = "cpu"
cpu_replicas = 2
prefill = 1
inactive = 1
"""

MODELS = """
[[models]]
name = "beta"
path = "/models/beta"
min_prefill = 0
min_decode = 0
keep_alive_s = 2.5

[[models]]
name = "gamma"
path = "/models/gamma"
max_decode = 3
"""


def test_models_tables_reach_the_router_and_every_replica(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", BASE + MODELS)
    assert [(m.name, m.path) for m in cluster.models] == [("beta", Path("/models/beta")),
                                                           ("gamma", Path("/models/gamma"))]
    args = router_args(cluster, [])
    at = args.index("--models")
    assert args[at + 1: at + 3] == ["beta=/models/beta,min-prefill=0,min-decode=0,keep-alive=2.5",
                                    "gamma=/models/gamma,max-decode=3"]
    beta = parse_model(args[at + 1])  # the router reads back what the file said
    assert (beta.name, beta.path, dict(beta.overrides)) == (
        "beta", Path("/models/beta"), {"min_prefill": 0, "min_decode": 0, "keep_alive": 2.5})
    cpu = Inventory("h", (), (), Cpus((0, 1, 2, 3), {0: (0, 1, 2, 3)}), "", (7000, 7001, 7002, 7003), "eth0")
    placed = place(cluster, {0: cpu})
    commands = Commands(cluster, "unit", ("pdcluster",), PurePosixPath("/run"))
    for placement in placed:
        replica = commands.replica_args(placement)
        at = replica.index("--weight-buffer-models")
        assert replica[at + 1: at + 4] == ["/models/alpha", "/models/beta", "/models/gamma"]
    assert "--models" not in router_args(parse(tmp_path / "c.toml", BASE), [])  # none: one model


@pytest.mark.parametrize(("entry", "line", "message"), [
    ('[[models]]\nname = "b"\npath = "/models/b"\nmin_prefil = 0\n', 14,
     "unknown key 'models\\[0\\].min_prefil'"),
    ('[[models]]\npath = "/models/b"\n', 11, "needs name"),
    ('[[models]]\nname = "b"\n', 11, "needs path"),
    ('[[models]]\nname = "alpha"\npath = "/models/b"\n', 12, "already the \\[model\\]'s folder name"),
    ('[[models]]\nname = "b"\npath = "/models/b"\n[[models]]\nname = "b"\npath = "/models/c"\n', 15,
     "models\\[1\\]: model name 'b' is already models\\[0\\]"),
    ('[[models]]\nname = "b"\npath = "/elsewhere/b"\n', 13, "must sit directly in the replicas' model root"),
    ('[[models]]\nname = "b"\npath = "/models/b"\nmin_decode = -1\n', 14, "min_decode must be a number >= 0"),
    ('[[models]]\nname = "b"\npath = "/models/b"\nmax_prefill = 1.5\n', 14, "whole number"),
    ('[[models]]\nname = "b"\npath = "/models/b"\nmin_prefill = 3\nmax_prefill = 2\n', 14,
     "min_prefill 3 is above max_prefill 2"),
    ('[[models]]\nname = "b,c"\npath = "/models/b"\n', 12, "may not hold commas"),
])
def test_a_bad_models_entry_names_its_line(tmp_path: Path, entry: str, line: int, message: str) -> None:
    text = BASE + "\n" + entry
    with pytest.raises(ClusterFileError, match=f"c.toml:{line}: .*{message}"):
        parse(tmp_path / "c.toml", text)


def test_models_must_be_tables(tmp_path: Path) -> None:
    with pytest.raises(ClusterFileError, match=r"c\.toml:1: models must be \[\[models\]\] tables"):
        parse(tmp_path / "c.toml", 'models = "beta"\n' + BASE)
