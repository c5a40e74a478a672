"""`pdcluster bench migration`'s arithmetic: shapes in the budget, bytes per shape, the summary."""

from __future__ import annotations

import pytest

from pdcluster.bench.migration import BenchMigrationConfig, _summary


def test_shapes_within_the_token_budget_smallest_first() -> None:
    config = BenchMigrationConfig(requests=[8, 1], tokens=[2048, 128], max_batch_tokens=4096)
    assert config.shapes() == [(1, 128), (8, 128), (1, 2048)]


def test_kv_bytes_count_whole_pages_of_every_layer() -> None:
    config = BenchMigrationConfig(layers=8, hidden=128, block_size=16)
    assert config.page_bytes() == 2 * 16 * 128 * 4
    assert config.kv_bytes(1, 128) == 8 * config.page_bytes() * 8 == 1 << 20
    assert config.kv_bytes(1, 129) == 9 * config.page_bytes() * 8  # a partial page moves whole


def test_summary_weighs_the_sweep_by_bytes() -> None:
    rows = [
        {"ratio": 0.25, "p2p_s": 0.001, "migrate_s": 0.004},
        {"ratio": 0.9, "p2p_s": 0.090, "migrate_s": 0.100},
        {"ratio": 0.5, "p2p_s": 0.009, "migrate_s": 0.018},
    ]
    summary = _summary(rows)
    assert summary["min_ratio"] == 0.25 and summary["median_ratio"] == 0.5
    assert summary["aggregate_ratio"] == pytest.approx(0.100 / 0.122)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        BenchMigrationConfig(hidden=100, kv_heads=8)
    with pytest.raises(ValueError):
        BenchMigrationConfig(requests=[])
