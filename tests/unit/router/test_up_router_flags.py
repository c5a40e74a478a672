"""`pdcluster up --router-flag NAME=VALUE` reaches the router's parser: a value, or a boolean flag
(`true` / `false`, as the cluster file writes them) as `--NAME` / `--no-NAME`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.cli.main import parse
from pdcluster.cluster.local import UpConfig
from router.config import RouterConfig


def _router(tmp_path: Path, *flags: str) -> RouterConfig:
    args = UpConfig(model=tmp_path, router_flag=list(flags)).router_args()
    config = parse(["router", "--model", str(tmp_path), "--replica", "127.0.0.1:1", *args])
    assert isinstance(config, RouterConfig)
    return config


def test_boolean_router_flags_reach_the_router(tmp_path: Path) -> None:
    assert _router(tmp_path).ignore_unknown_fields is False
    assert _router(tmp_path, "ignore-unknown-fields=true").ignore_unknown_fields is True
    assert _router(tmp_path, "ignore-unknown-fields=True").ignore_unknown_fields is True
    assert _router(tmp_path, "ignore-unknown-fields=false").ignore_unknown_fields is False


def test_valued_router_flags_keep_their_value(tmp_path: Path) -> None:
    config = _router(tmp_path, "keep-alive=2.5", "ignore-unknown-fields=true")
    assert (config.keep_alive, config.ignore_unknown_fields) == (2.5, True)


def test_unknown_or_launch_set_router_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'keep-alive-s' is not a flag of this command"):
        UpConfig(model=tmp_path, router_flag=["keep-alive-s=3"])
    with pytest.raises(ValueError, match="--router-flag scaling: 'scaling' is set by the launch"):
        UpConfig(model=tmp_path, router_flag=["scaling=live"])
    assert UpConfig(model=tmp_path, router_flag=["min-prefill=1"]).router_flag == ["min-prefill=1"]
