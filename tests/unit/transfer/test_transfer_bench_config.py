"""The transfer benchmark's config: sizes parse, impossible set-ups are refused before any process."""

from __future__ import annotations

import pytest

from pdcluster.bench.transfer import BenchTransferConfig, parse_size


def test_sizes() -> None:
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    assert parse_size("1.5kb") == 1500
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"ranks": 1}, "at least 2"), ({"algo": "p2p", "ranks": 3}, "exactly 2"),
     ({"algo": "tanz", "ranks": 5, "sources": 2}, "split evenly"), ({"size": "huge"}, "not a size")],
)
def test_bad_configs(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchTransferConfig(**overrides)  # type: ignore[arg-type]


def test_defaults_are_valid() -> None:
    config = BenchTransferConfig(algo="tanz", ranks=6, sources=2)
    assert config.sources == 2 and config.json_out is None
