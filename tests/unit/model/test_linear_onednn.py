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
    """These tests are of the oneDNN path (`--cpu-onednn`, the default; a test may turn it off)."""
    linear_module.use_onednn(True)
    yield
    linear_module.use_onednn(True)


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


def test_row_buckets_are_few_and_tight() -> None:
    """oneDNN sees ~20 row counts (its memory grows per distinct shape): under 8 padding rows up to
    64 rows, under a quarter of the real rows past that."""
    sizes = linear_module.buckets()
    assert len(sizes) <= 24 and sizes[-1] == linear_module.CHUNK
    for rows in range(1, linear_module.CHUNK + 1):
        padded = linear_module.bucket_rows(rows)
        assert padded in sizes and rows <= padded < rows + max(8, rows // 4)


@pytest.mark.parametrize("rows", [63, 65, linear_module.CHUNK + 77])
def test_padded_and_chunked_rows_match_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(40)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_warm_runs_every_bucket_once_per_kind_of_weight() -> None:
    a, b, c = torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16)
    assert linear_module.warm([(a, None), (b, None), (c, None), (a, torch.zeros(8))]) == 3 * len(
        linear_module.buckets()
    )
    linear_module.use_onednn(False)
    assert linear_module.warm([(a, None)]) == 0
