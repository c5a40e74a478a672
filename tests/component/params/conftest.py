"""Two tiny checkpoints of one shape and other weights (a receiver holding the wrong one would
generate other tokens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def alpha(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=2)


@pytest.fixture(scope="module")
def beta(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=2, seed=23)  # one shape, other weights
