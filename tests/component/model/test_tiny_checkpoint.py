"""The tiny-checkpoint maker: a folder transformers loads as-is, with a working locally trained tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pdcluster.cli import main as cli_main
from pdcluster.tools.tiny_model import TinyModelConfig
from replica.model.config import ModelConfig

transformers = pytest.importorskip("transformers")


def test_tokenizer_loads_and_round_trips(tiny_llama: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    config = ModelConfig.from_dir(tiny_llama)
    assert len(tok) <= config.vocab_size
    text = "The quick brown fox said hello to the little town."
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2 == config.eos_token_ids[0]
    assert len(ids) < 0.6 * len(text)  # merges were learned (bytes alone: one token per character)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template(tiny_llama: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s><|user|>\nHi there</s>\n<|assistant|>\n"


def test_transformers_loads_every_architecture(tiny_model_factory: Callable[..., Path]) -> None:
    for arch, cls in (
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
    ):
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch=arch))
        assert type(model).__name__ == cls


def test_cli_writes_sharded_bfloat16_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert (
        cli_main(
            [
                "make-tiny-model",
                str(out),
                "--arch",
                "qwen2",
                "--layers",
                "3",
                "--hidden",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--intermediate",
                "48",
                "--vocab",
                "400",
                "--dtype",
                "bfloat16",
                "--shards",
                "2",
                "--seed",
                "9",
            ]
        )
        == 0
    )
    config = ModelConfig.from_dir(out)
    assert (config.architecture, config.num_layers, config.hidden_size, config.vocab_size) == (
        "Qwen2ForCausalLM",
        3,
        32,
        400,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (out / name).is_file()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="vocab"):
        TinyModelConfig(out=Path("x"), vocab=100)
    with pytest.raises(ValueError, match="kv_heads"):
        TinyModelConfig(out=Path("x"), heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="arch"):
        TinyModelConfig(out=Path("x"), arch="gpt2")
    with pytest.raises(ValueError, match="JSON"):
        TinyModelConfig(out=Path("x"), rope_scaling="{factor: 2")
    with pytest.raises(ValueError, match="longrope"):
        TinyModelConfig(out=Path("x"), rope_scaling='{"rope_type": "longrope", "factor": 2.0}')


def test_cli_reports_invalid_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["make-tiny-model", str(tmp_path / "m"), "--rope-scaling", "[1, 2]"]) == 2
    assert "rope_scaling must be a JSON object" in capsys.readouterr().err
