"""`pdcluster up`'s plan: roles by rank, and the rank table it writes once replicas take `--cluster`."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.local_cluster import LocalCluster, UpConfig
from transfer.ranktable import load_rank_table


def test_roles_by_rank_and_validation(tmp_path: Path) -> None:
    cluster = LocalCluster(UpConfig(model=tmp_path, prefill=2, decode=1, inactive=1, log_dir=tmp_path))
    assert cluster.roles() == ["prefill", "prefill", "decode", "inactive"]
    with pytest.raises(ValueError):
        UpConfig(model=tmp_path, prefill=0, decode=0)


def test_rank_table_written_for_every_replica(tmp_path: Path) -> None:
    cluster = LocalCluster(UpConfig(model=tmp_path, prefill=1, decode=2, log_dir=tmp_path))
    args = cluster._fabric_args()
    assert args[0] == "--cluster" and args[2:] == ["--fabric", "tcp"]
    table = load_rank_table(args[1])
    assert [e.rank for e in table] == [0, 1, 2]
    assert len({e.transfer_address for e in table}) == 3
