"""`replica.model.linear.linear` is `F.linear` up to float32 rounding (oneDNN on the CPU), reads the
weight's bytes at each call (weights may arrive after the model is built), and keeps `F.linear`
itself for other dtypes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from replica.model import linear as linear_module
from replica.model.linear import linear


@pytest.fixture(autouse=True)
def onednn() -> Iterator[None]:
    """These tests are of the oneDNN path (`--cpu-onednn`); the default is `F.linear`."""
    linear_module.use_onednn(True)
    yield
    linear_module.use_onednn(False)


@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    full = torch.randn(300, 96, generator=g) * 0.05
    weight = full[40:240]  # a view into a larger buffer, as the model's parameters are
    bias = torch.randn(200, generator=g) if with_bias else None
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert linear(x[:, ::2], weight[:, :48]).shape == (rows, 200)  # non-contiguous input


def test_weight_written_after_a_call_is_seen() -> None:
    x, weight = torch.randn(4, 16), torch.zeros(8, 16)
    assert torch.count_nonzero(linear(x, weight)) == 0
    weight.copy_(torch.eye(8, 16))
    torch.testing.assert_close(linear(x, weight), x[:, :8])


def test_bfloat16_is_f_linear_bit_for_bit() -> None:
    x, weight = torch.randn(5, 32).bfloat16(), torch.randn(12, 32).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
