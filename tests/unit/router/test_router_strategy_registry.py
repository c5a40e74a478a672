"""Migration strategies are found by name: the five built-in ones, each a module of
router/strategies/, listed first in `Strategy` order; an unknown name is refused by the registry
and by the config (`--strategy`)."""

from __future__ import annotations

import pytest

from router import strategies
from router.config import RouterConfig
from router.strategies import Strategy
from router.strategies.base import MigrationStrategy


def test_every_built_in_strategy_is_a_registered_module_listed_first_in_enum_order() -> None:
    names = strategies.names()
    assert names[:len(Strategy)] == [s.value for s in Strategy]
    for name in names:
        strategy = strategies.get(name)
        assert isinstance(strategy, MigrationStrategy) and strategy.name == name
    for built_in in Strategy:
        assert type(strategies.get(built_in)).__module__ == f"router.strategies.{built_in.value}"
    assert strategies.get(Strategy.RECOMPUTE) is strategies.get("recompute")


def test_an_unknown_strategy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="full"):
        strategies.get("teleport")
    with pytest.raises(ValueError, match="teleport"):
        RouterConfig(model="m", strategy="teleport")  # type: ignore[arg-type]
    assert RouterConfig(model="m", strategy=Strategy.MUTATE).strategy == "mutate"  # type: ignore[arg-type]
