"""Packed float32 CPU linear weights (`--cpu-packed-weights`, on by default): a loaded engine packs
every linear weight, computes the same logits as without packs, drops them when its weights are
reset (ResetStatus / a fill) and packs again once every region has landed, reading the new bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica.config import ReplicaConfig
from replica.engine.factory import build_engine_and_params
from replica.engine.packing import linear_weights
from replica.model import linear
from replica.model.attention import AttentionContext, SeqSlice

pytestmark = pytest.mark.skipif(not linear.packable(torch.zeros(1, 1)), reason="torch without oneDNN")


def _logits(engine: object, tokens: list[int]) -> torch.Tensor:
    runner = engine.runner  # type: ignore[attr-defined]
    model, cache = runner.model, runner.cache
    ctx = AttentionContext.build(cache, [SeqSlice((0, 1), 0, len(tokens))], model.config)
    hidden = model(torch.tensor(tokens), ctx)
    return model.head(hidden[ctx.last_token_index])


def _engine(model: Path, packed: bool, inactive: bool = False) -> tuple[object, object]:
    config = ReplicaConfig(
        model=model, port=0, num_blocks=4, block_size=16, cpu_onednn=True, cpu_packed_weights=packed,
        inactive=inactive,
    )
    return build_engine_and_params(config, "cpu")


def test_packs_give_the_plain_logits_and_follow_resets(tiny_llama: Path) -> None:
    tokens = [5, 9, 13, 2, 7, 11]
    engine, params = _engine(tiny_llama, packed=True)
    plain_engine, _ = _engine(tiny_llama, packed=False)
    weights = linear_weights(engine.runner.model)  # type: ignore[attr-defined]
    assert all(linear.is_packed(w) for w in weights)
    assert not any(linear.is_packed(w) for w in linear_weights(plain_engine.runner.model))  # type: ignore[attr-defined]
    want = _logits(plain_engine, tokens)
    torch.testing.assert_close(_logits(engine, tokens), want, rtol=1e-5, atol=1e-5)
    params.unload()  # type: ignore[attr-defined]
    assert not any(linear.is_packed(w) for w in weights)
    params.buffer.zero_()  # type: ignore[attr-defined]  # plain bytes change while unpacked: read as they are
    assert torch.count_nonzero(_logits(engine, tokens)) == 0
    params.load_from_host()  # type: ignore[attr-defined]
    assert all(linear.is_packed(w) for w in weights)
    torch.testing.assert_close(_logits(engine, tokens), want, rtol=1e-5, atol=1e-5)


def test_an_inactive_engine_packs_once_loaded(tiny_llama: Path) -> None:
    engine, params = _engine(tiny_llama, packed=True, inactive=True)
    weights = linear_weights(engine.runner.model)  # type: ignore[attr-defined]
    assert not any(linear.is_packed(w) for w in weights)
    params.load_from_disk(tiny_llama)  # type: ignore[attr-defined]
    assert all(linear.is_packed(w) for w in weights)
