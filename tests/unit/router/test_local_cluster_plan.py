"""`pdcluster up`'s plan: roles by rank, and the rank table it writes once replicas take `--cluster`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from pdcluster.cluster.placement import Placement
from transfer.ranktable import load_rank_table


def test_roles_by_rank_and_validation(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cluster = LocalCluster(UpConfig(model=tmp_path, prefill=2, decode=1, inactive=1, log_dir=tmp_path))
    assert cluster.roles() == ["prefill", "prefill", "decode", "inactive"]
    with pytest.raises(ValueError):
        UpConfig(model=tmp_path, prefill=0, decode=0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"scaling": "fast"}, "unknown scaling policy 'fast'"),
    ({"strategy": "teleport"}, "unknown migration strategy 'teleport'"),
    ({"router_flag": ["--min-prefill=2"]}, "NAME=VALUE"),
    ({"router_flag": ["min-prefill"]}, "NAME=VALUE"),
    ({"host_cache_bytes": -1}, "--host-cache-bytes must be >= 0"),
])
def test_bad_flags_are_refused_at_start(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UpConfig(model=tmp_path, **fields)  # type: ignore[arg-type]


def test_inactive_replicas_need_a_checkpoint_they_can_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        UpConfig(model=tmp_path / "missing", inactive=2)


def test_scaling_and_emulated_devices_reach_the_processes(tmp_path: Path) -> None:
    config = UpConfig(model=tmp_path, scaling="live", router_flag=["min-prefill=1", "keep-alive=2.5"],
                      disk_gbps=16.0, host_gbps=200.0, link_gbps=2.0, log_dir=tmp_path)
    assert config.router_args() == ["--scaling", "live", "--routing", "cache-aware", "--min-prefill", "1",
                                    "--keep-alive", "2.5"]
    assert config.replica_args() == ["--disk-gbps", "16.0", "--host-gbps", "200.0"]
    small = UpConfig(model=tmp_path, host_cache=True, host_cache_bytes=10**9, log_dir=tmp_path)
    assert small.replica_args()[-2:] == ["--host-cache-bytes", "1000000000"]
    plain = UpConfig(model=tmp_path, routing="load", prefix_cache=False, log_dir=tmp_path)
    assert plain.router_args()[2:4] == ["--routing", "load"] and "--no-prefix-cache" in plain.replica_args()
    table = load_rank_table(LocalCluster(config)._fabric_args([7001, 7002])[1])
    assert [(e.node, e.link_gbps) for e in table] == [("n0", 2.0), ("n1", 2.0)]


def test_rank_table_written_for_every_replica(tmp_path: Path) -> None:
    cluster = LocalCluster(UpConfig(model=tmp_path, prefill=1, decode=2, log_dir=tmp_path))
    args = cluster._fabric_args([7001, 7002, 7003])
    assert args[0] == "--cluster" and args[2:] == ["--fabric", "tcp"]
    table = load_rank_table(args[1])
    assert [e.rank for e in table] == [0, 1, 2]
    assert len({e.transfer_address for e in table}) == 3


def test_pinned_placement_gives_each_decode_replica_a_core() -> None:
    placement = Placement.plan(2, {0, 1, 2, 3})
    assert placement.decode == (frozenset({2}), frozenset({3})) and placement.shared == frozenset({0, 1})
    assert Placement.plan(1, {0, 1}).shared == frozenset({0})
    with pytest.raises(ValueError):
        Placement.plan(2, {0, 1})  # nothing left for the router


def test_pinned_cluster_spawns_each_role_on_its_cores(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning needs at least 2 cores")
    cluster = LocalCluster(UpConfig(model=tmp_path, prefill=1, decode=1, log_dir=tmp_path, pin_decode=True))
    assert cluster.placement is not None
    own, shared = cluster.placement.decode[0], cluster.placement.shared
    # the decode replica may use both; its engine thread alone takes its own core (--engine-cpus)
    assert cluster._cpus("decode", 0) == own | shared
    assert cluster._engine_args("decode", 0) == ["--engine-cpus", *map(str, sorted(own))]
    assert cluster._cpus("prefill", 0) == cluster._cpus("router", 0) == shared
    assert cluster._engine_args("prefill", 0) == cluster._engine_args("router", 0) == []


def test_up_tp_gives_each_group_consecutive_ranks(tmp_path: Path) -> None:
    config = UpConfig(model=tmp_path, prefill=0, decode=2, tp=2, link_gbps=1.0, log_dir=tmp_path)
    cluster = LocalCluster(config)
    table = load_rank_table(cluster._fabric_args([7001, 7002, 7003, 7004])[1])
    assert [(e.rank, e.node, e.tp_group) for e in table] == [(0, "n0", None), (1, "n0", 0), (2, "n1", None),
                                                              (3, "n1", 2)]
    args = cluster.replica_argv(1, "decode", 5000, [])
    assert args[args.index("--rank") + 1] == "2"  # replica 1: ranks 2 and 3
