"""Migration strategies as plug-ins: one module each, found by name.

Every module of this package (but `base`) that sets `STRATEGY` to a `MigrationStrategy` is
registered under `STRATEGY.name`; `--strategy NAME` and the admin `SetMigrationStrategy` pick one.
`Strategy` names the built-in ones (launchers and tests use it); `names()` lists them first, in
that order, then any other found.
"""

from __future__ import annotations

import enum
import functools
import importlib
import pkgutil

from router.strategies.base import MigrationStrategy


class Strategy(enum.Enum):
    """The built-in strategies' names."""

    FULL = "full"
    PROGRESSIVE = "progressive"
    MUTATE = "mutate"
    RECOMPUTE = "recompute"
    COLOCATED = "colocated"


@functools.cache
def _registry() -> dict[str, MigrationStrategy]:
    found: dict[str, MigrationStrategy] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name == "base" or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        strategy = getattr(module, "STRATEGY", None)
        if not isinstance(strategy, MigrationStrategy):
            continue
        if not strategy.name or strategy.name in found:
            raise ValueError(f"{module.__name__}: strategy name {strategy.name!r} is empty or taken")
        found[strategy.name] = strategy
    built_in = [s.value for s in Strategy]
    order = built_in + sorted(n for n in found if n not in built_in)
    return {n: found[n] for n in order if n in found}


def names() -> list[str]:
    """Every registered strategy's name: the built-in ones first, in `Strategy` order."""
    return list(_registry())


def get(name: str | Strategy) -> MigrationStrategy:
    """The strategy registered under `name` (ValueError when none is)."""
    key = name.value if isinstance(name, Strategy) else name
    strategy = _registry().get(key)
    if strategy is None:
        raise ValueError(f"unknown migration strategy {key!r}; choose from {names()}")
    return strategy
