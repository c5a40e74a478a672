"""Test tiers by folder: tests/unit, component, cluster, gpu, rdma get their marker automatically.

Shared fixtures: tiny random-weight checkpoints (built once per session, per architecture) in a
session temp folder; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

TIERS = ("unit", "component", "cluster", "hosts", "gpu", "rdma")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        try:
            tier = Path(item.fspath).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (once per distinct argument set) a tiny checkpoint and return its folder."""
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    built: dict[tuple[tuple[str, object], ...], Path] = {}

    def build(**overrides: object) -> Path:
        key = tuple(sorted(overrides.items()))
        if key not in built:
            name = "-".join(f"{k}{v}" for k, v in key) or "default"
            out = tmp_path_factory.mktemp(f"tiny-{name}")
            make_tiny_model(TinyModelConfig(out=out, **overrides))  # type: ignore[arg-type]
            built[key] = out
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny Llama checkpoint."""
    return tiny_model_factory(arch="llama")
