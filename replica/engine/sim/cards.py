"""Model cards: the hyper-parameters of the models a simulated replica can run (pure data).

A card is a Hugging Face `config.json` (the same keys, parsed by `ModelConfig.from_dict`), so any
checkpoint's config can be a card: `--model-card FILE` takes a `config.json`, a folder holding one,
or a `.toml` with the same keys. Sizes follow from it: weight bytes from the weight layout, KV bytes
per token from layers × KV heads × head dim, FLOPs per token from the parameter count.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from replica.model.config import ModelConfig

_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "torch_dtype": "bfloat16"}

CARDS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {**_LLAMA, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "llama-2-13b": {**_LLAMA, "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
                    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "llama-3-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "bos_token_id": 128000,
                   "eos_token_id": [128001, 128009]},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "torch_dtype": "bfloat16",
                   "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "bos_token_id": 1,
                   "eos_token_id": 2},
    "qwen2-7b": {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "torch_dtype": "bfloat16",
                 "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "max_position_embeddings": 32768, "rope_theta": 1000000.0, "eos_token_id": 151643},
    "qwen2-1.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "torch_dtype": "bfloat16",
                   "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                   "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "eos_token_id": 151643},
}


def card_dict(name_or_file: str) -> Mapping[str, Any]:
    """The config dict of a built-in card, or of a file / checkpoint folder."""
    if name_or_file in CARDS:
        return CARDS[name_or_file]
    path = Path(name_or_file)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model card {name_or_file!r} is neither built in ({', '.join(CARDS)}) nor a file")
    text = path.read_text()
    raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"model card {path} is not a table of config keys")
    return raw


def load_card(name_or_file: str) -> ModelConfig:
    """The model a card describes."""
    return ModelConfig.from_dict(card_dict(name_or_file))


def card_dtype(name_or_file: str) -> str:
    """The card's weight and KV dtype (bfloat16 when it names none)."""
    dtype = card_dict(name_or_file).get("torch_dtype") or "bfloat16"
    return "float16" if dtype == "half" else str(dtype)
