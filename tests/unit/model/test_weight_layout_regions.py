"""WeightLayout: ordered contiguous regions, aligned offsets, sizes, tied embeddings, shards."""

from __future__ import annotations

from typing import Any

import pytest

from replica.model.config import ModelConfig, UnsupportedModel
from replica.model.layout import ITEMSIZE, RegionKind, Shard, WeightLayout


def _config(**overrides: Any) -> ModelConfig:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def _weights_bytes(c: ModelConfig, itemsize: int) -> int:
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    layer = 2 * h + h * c.q_size * 2 + 2 * h * c.kv_size + 3 * h * i
    head = h + (0 if c.tie_word_embeddings else v * h)
    return (v * h + c.num_layers * layer + head) * itemsize


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_regions_ordered_contiguous_and_tile_the_buffer(dtype: str) -> None:
    c = _config()
    layout = WeightLayout.for_config(c, dtype)
    names = [r.name for r in layout.regions]
    assert names == ["embed", "layer.0", "layer.1", "layer.2", "head"]
    assert [r.kind for r in layout.regions] == [RegionKind.EMBED] + [RegionKind.LAYER] * 3 + [RegionKind.HEAD]
    assert [r.index for r in layout.regions[1:4]] == [0, 1, 2]
    assert layout.regions[0].offset == 0
    for before, after in zip(layout.regions, layout.regions[1:], strict=False):
        assert before.end == after.offset
    assert layout.regions[-1].end == layout.total_bytes
    # every tensor inside its region, aligned, non-overlapping, in order
    for region in layout.regions:
        cursor = region.offset
        for t in region.tensors:
            assert t.offset % layout.alignment == 0 and t.offset >= cursor and t.end <= region.end
            assert t.dtype == dtype
            cursor = t.end
        assert region.nbytes % layout.alignment == 0
    assert sum(t.nbytes for t in layout.tensors().values()) == _weights_bytes(c, ITEMSIZE[dtype])


def test_layer_tensors_and_shapes() -> None:
    layout = WeightLayout.for_config(_config(), "float32")
    layer = {t.name.removeprefix("model.layers.1."): t.shape for t in layout.region("layer.1").tensors}
    assert layer == {
        "input_layernorm.weight": (64,),
        "self_attn.q_proj.weight": (64, 64),
        "self_attn.k_proj.weight": (32, 64),
        "self_attn.v_proj.weight": (32, 64),
        "self_attn.o_proj.weight": (64, 64),
        "post_attention_layernorm.weight": (64,),
        "mlp.gate_proj.weight": (96, 64),
        "mlp.up_proj.weight": (96, 64),
        "mlp.down_proj.weight": (64, 96),
    }
    assert [t.name for t in layout.region("embed").tensors] == ["model.embed_tokens.weight"]
    assert [t.name for t in layout.region("head").tensors] == ["model.norm.weight", "lm_head.weight"]
    assert layout.lm_head.name == "lm_head.weight"


def test_tied_embeddings_head_holds_only_the_norm() -> None:
    untied = WeightLayout.for_config(_config(), "float32")
    tied = WeightLayout.for_config(_config(tie_word_embeddings=True), "float32")
    assert [t.name for t in tied.region("head").tensors] == ["model.norm.weight"]
    assert tied.lm_head == tied.tensors()["model.embed_tokens.weight"]
    assert untied.total_bytes - tied.total_bytes == 1000 * 64 * 4


def test_biases_present_for_qwen2_and_llama_flags() -> None:
    qwen = WeightLayout.for_config(_config(architectures=["Qwen2ForCausalLM"]), "float32")
    names = {t.name for t in qwen.region("layer.0").tensors}
    assert {f"model.layers.0.self_attn.{n}_proj.bias" for n in "qkv"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    llama = WeightLayout.for_config(_config(attention_bias=True, mlp_bias=True), "float32")
    names = {t.name for t in llama.region("layer.0").tensors}
    assert "model.layers.0.self_attn.o_proj.bias" in names and "model.layers.0.mlp.down_proj.bias" in names


def test_qkv_and_gate_up_adjacent_when_sizes_align() -> None:
    layout = WeightLayout.for_config(_config(), "float32")
    t = layout.tensors()
    p = "model.layers.0."
    assert t[p + "self_attn.k_proj.weight"].offset == t[p + "self_attn.q_proj.weight"].end
    assert t[p + "self_attn.v_proj.weight"].offset == t[p + "self_attn.k_proj.weight"].end
    assert t[p + "mlp.up_proj.weight"].offset == t[p + "mlp.gate_proj.weight"].end


def test_tensor_parallel_shard_shapes() -> None:
    layout = WeightLayout.for_config(_config(), "float32", shard=Shard(rank=1, world=2))
    t = layout.tensors()
    assert t["model.embed_tokens.weight"].shape == (500, 64)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (64, 48)
    assert t["model.layers.0.input_layernorm.weight"].shape == (64,)


def test_fewer_kv_heads_than_ranks_share_whole_heads() -> None:
    # 2 KV heads over 4 ranks: one head per rank, ranks 0-1 hold head 0 and ranks 2-3 head 1
    layout = WeightLayout.for_config(_config(), "float32", shard=Shard(rank=3, world=4))
    k = layout.tensors()["model.layers.0.self_attn.k_proj.weight"]
    assert k.shape == (16, 64) and k.parts == 2
    assert layout.tensors()["model.layers.0.self_attn.q_proj.weight"].parts == 0


def test_tensor_parallel_degree_must_divide() -> None:
    with pytest.raises(UnsupportedModel, match="num_key_value_heads=2"):
        WeightLayout.for_config(_config(), "float32", shard=Shard(rank=0, world=3))
    with pytest.raises(ValueError, match="rank"):
        Shard(rank=2, world=2)


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(UnsupportedModel, match="int8"):
        WeightLayout.for_config(_config(), "int8")


def test_segments_and_signature() -> None:
    layout = WeightLayout.for_config(_config(), "bfloat16")
    assert layout.segments() == [(r.offset, r.nbytes) for r in layout.regions]
    signature = layout.signature()
    assert signature["total_bytes"] == layout.total_bytes and signature["dtype"] == "bfloat16"
    assert signature == WeightLayout.for_config(_config(), "bfloat16").signature()
    assert signature != WeightLayout.for_config(_config(), "float32").signature()
    assert signature != WeightLayout.for_config(_config(vocab_size=1002), "bfloat16").signature()
