"""ModelConfig parsing: fields, architecture traits, RoPE scaling, EOS/BOS, errors naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replica.errors import InvalidArgument
from replica.model.config import CheckpointError, ModelConfig, RopeKind, UnsupportedModel


def _raw(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5e5,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def test_llama_fields() -> None:
    c = ModelConfig.from_dict(_raw())
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM",
        1000,
        64,
        128,
    )
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (3, 4, 2, 16)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 5e5, 256)
    assert (c.eos_token_ids, c.bos_token_id, c.torch_dtype) == ((2,), 1, "bfloat16")
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias or c.tie_word_embeddings)
    assert c.rope_scaling.kind is RopeKind.DEFAULT
    assert [c.window(i) for i in range(3)] == [None, None, None]


def test_explicit_head_dim_and_default_kv_heads() -> None:
    c = ModelConfig.from_dict(_raw(head_dim=40, num_key_value_heads=None))
    assert (c.head_dim, c.num_kv_heads, c.q_size, c.kv_size) == (40, 4, 160, 160)


def test_llama_bias_flags() -> None:
    c = ModelConfig.from_dict(_raw(attention_bias=True, mlp_bias=True))
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (True, True, True)


def test_qwen2_biases_and_per_layer_windows() -> None:
    c = ModelConfig.from_dict(
        _raw(
            architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8, max_window_layers=2
        )
    )
    assert (c.qkv_bias, c.o_bias) == (True, False)
    assert [c.window(i) for i in range(3)] == [None, None, 8]
    off = ModelConfig.from_dict(_raw(architectures=["Qwen2ForCausalLM"], sliding_window=8))
    assert off.window(2) is None  # use_sliding_window false: the window is not used


def test_mistral_window_all_layers() -> None:
    c = ModelConfig.from_dict(_raw(architectures=["MistralForCausalLM"], sliding_window=16))
    assert [c.window(i) for i in range(3)] == [16, 16, 16]
    assert (
        ModelConfig.from_dict(_raw(architectures=["MistralForCausalLM"], sliding_window=None)).window(0)
        is None
    )


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(_raw(architectures=["GPT2LMHeadModel"]))


def test_model_type_fallback_without_architectures() -> None:
    c = ModelConfig.from_dict(_raw(architectures=None, model_type="mistral"))
    assert c.architecture == "MistralForCausalLM"


def test_missing_key_is_named() -> None:
    raw = _raw()
    del raw["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(CheckpointError, match="num_key_value_heads=3"):
        ModelConfig.from_dict(_raw(num_key_value_heads=3))


def test_partial_rotary_factor_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor"):
        ModelConfig.from_dict(_raw(partial_rotary_factor=0.5))


def test_unsupported_activation_is_named() -> None:
    with pytest.raises(UnsupportedModel, match="gelu"):
        ModelConfig.from_dict(_raw(hidden_act="gelu"))


@pytest.mark.parametrize(
    ("scaling", "kind"),
    [
        ({"type": "linear", "factor": 2.0}, RopeKind.LINEAR),
        ({"rope_type": "dynamic", "factor": 2.0}, RopeKind.DYNAMIC),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16}, RopeKind.YARN),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            RopeKind.LLAMA3,
        ),
    ],
)
def test_rope_scaling_kinds(scaling: dict[str, Any], kind: RopeKind) -> None:
    c = ModelConfig.from_dict(_raw(rope_scaling=scaling))
    assert c.rope_scaling.kind is kind
    assert c.rope_scaling.factor == scaling["factor"]


def test_rope_scaling_unknown_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModel, match="longrope"):
        ModelConfig.from_dict(_raw(rope_scaling={"rope_type": "longrope", "factor": 2.0}))


def test_rope_scaling_missing_parameter_is_named() -> None:
    with pytest.raises(CheckpointError, match="low_freq_factor"):
        ModelConfig.from_dict(
            _raw(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            )
        )


def test_errors_are_invalid_argument() -> None:
    assert issubclass(UnsupportedModel, InvalidArgument) and issubclass(CheckpointError, InvalidArgument)


def test_from_dir_reads_generation_config_eos_list(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_raw()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    c = ModelConfig.from_dir(tmp_path)
    assert c.eos_token_ids == (2, 7)


def test_from_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
