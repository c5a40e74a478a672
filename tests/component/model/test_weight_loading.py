"""Loading safetensors into the flat buffer: region callbacks, casts, shards, views, and clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.model.config import CheckpointError, ModelConfig
from replica.model.layout import Shard, WeightLayout
from replica.model.llama import build_model, load_model
from replica.model.weights import allocate_buffer, load_weights, tensor_views


def test_regions_reported_in_layout_order(tiny_llama: Path) -> None:
    seen: list[str] = []
    loaded = load_model(tiny_llama, torch.float32, on_region=seen.append)
    assert seen == [r.name for r in loaded.layout.regions]
    assert seen[0] == "embed" and seen[-1] == "head"


def test_values_land_in_views_and_parameters_alias_the_buffer(tiny_llama: Path) -> None:
    loaded = load_model(tiny_llama, torch.float32)
    stored = load_file(str(tiny_llama / "model.safetensors"))
    views = tensor_views(loaded.layout, loaded.buffer)
    for name, tensor in stored.items():
        assert torch.equal(views[name], tensor), name
    # parameters are views: writing the buffer changes the model
    q = loaded.model.layers[0].attn.qkv.weights[0]  # type: ignore[union-attr, index]
    assert q.untyped_storage().data_ptr() == loaded.buffer.untyped_storage().data_ptr()
    loaded.buffer.zero_()
    assert not q.any()


def test_cast_on_load(tiny_llama: Path) -> None:
    loaded = load_model(tiny_llama, torch.bfloat16)
    stored = load_file(str(tiny_llama / "model.safetensors"))
    views = tensor_views(loaded.layout, loaded.buffer)
    assert views["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(views["lm_head.weight"], stored["lm_head.weight"].to(torch.bfloat16))


def test_sharded_checkpoint_fills_the_same_buffer(tiny_model_factory: Callable[..., Path]) -> None:
    single = load_model(tiny_model_factory(arch="llama"), torch.float32)
    sharded_path = tiny_model_factory(arch="llama", shards=3)
    assert (sharded_path / "model.safetensors.index.json").is_file()
    sharded = load_model(sharded_path, torch.float32)
    assert torch.equal(single.buffer, sharded.buffer)


def test_tensor_parallel_shard_loads_its_slice(tiny_llama: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama)
    layout = WeightLayout.for_config(config, "float32", shard=Shard(rank=1, world=2))
    buffer = allocate_buffer(layout)
    load_weights(tiny_llama, layout, buffer)
    stored = load_file(str(tiny_llama / "model.safetensors"))
    views = tensor_views(layout, buffer)
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(views[q], stored[q][32:])
    assert torch.equal(views[o], stored[o][:, 32:])


def test_build_model_over_a_received_buffer(tiny_llama: Path) -> None:
    """A replica that receives weights over the network builds first, then the bytes arrive."""
    loaded = load_model(tiny_llama, torch.float32)
    buffer = allocate_buffer(loaded.layout)
    model = build_model(loaded.config, loaded.layout, buffer, torch.float32)
    buffer.copy_(loaded.buffer)  # the "transfer"
    ids = torch.tensor([1, 5, 9])
    assert torch.equal(model.head(model.embed(ids)), loaded.model.head(loaded.model.embed(ids)))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_names_tensor_and_files(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        load_model(path, torch.float32)


def test_unknown_extra_tensor_is_refused_but_inv_freq_ignored(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(path / "model.safetensors"))
    load_model(path, torch.float32)  # known-harmless
    tensors["model.layers.0.mlp.extra.weight"] = torch.ones(4)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mlp\.extra\.weight"):
        load_model(path, torch.float32)


def test_wrong_shape_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"mlp\.\w+_proj\.weight: shape \[\d+, \d+\] in model\.safetensors, config expects",
    ):
        load_model(path, torch.float32)


def test_index_naming_a_missing_file(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_model_factory(arch="llama", shards=3), tmp_path / "ckpt")
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003"):
        load_model(path, torch.float32)


def test_no_weights_at_all(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(tiny_llama / "config.json", path)
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_model(path, torch.float32)


def test_unaligned_matrices_are_not_fused(tiny_model_factory: Callable[..., Path]) -> None:
    """Fusion only over adjacent views: q/k/v biases of 40 and 8 floats leave alignment gaps."""
    odd = load_model(
        tiny_model_factory(arch="qwen2", hidden=40, heads=5, kv_heads=1, intermediate=72, seed=8),
        torch.float32,
    )
    assert not odd.model.layers[0].attn.qkv.fused  # type: ignore[union-attr]
    assert load_model(tiny_model_factory(arch="qwen2"), torch.float32).model.layers[0].attn.qkv.fused  # type: ignore[union-attr]


def test_truncated_file_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_model(path, torch.float32)
