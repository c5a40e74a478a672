"""The model's hyper-parameters, parsed from a Hugging Face `config.json` (pure Python, no torch).

`ModelConfig.from_dir(path)` reads `config.json` (and `generation_config.json` when present) and
returns one frozen dataclass the layout, the loader and the model math all read. The architecture
is chosen by the checkpoint's `architectures` entry through a registry; each entry parses the
architecture's own flags (biases, sliding windows). Anything we cannot reproduce exactly is refused
with an error naming it, never silently approximated.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replica.errors import InvalidArgument


class UnsupportedModel(InvalidArgument):
    """The checkpoint asks for something this model code does not implement (named in the message)."""


class CheckpointError(InvalidArgument):
    """The checkpoint folder is incomplete or inconsistent (a file or tensor is missing or malformed)."""


class RopeKind(enum.Enum):
    """How the rotary frequencies are derived (transformers' `rope_type`)."""

    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling parameters; only the fields of `kind` are meaningful.

    `dynamic` equals the default rotation for every position below `max_position_embeddings`, the
    only positions a replica accepts, so it is reproduced exactly there (transformers recomputes the
    frequencies only once a sequence grows past that length).
    """

    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model math, the weight layout and the engine need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # One flag per layer: does this layer use `sliding_window`? (Qwen2 mixes both kinds.)
    sliding_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise CheckpointError("config.json: layer_types must have one entry per layer")

    def window(self, layer: int) -> int | None:
        """The sliding-window length of `layer`, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (all KV heads)."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        """Parse `path/config.json` (+ `generation_config.json` for EOS/BOS when present)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"no config.json in {path}")
        raw = _read_json(config_file)
        generation_file = Path(path) / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
        """Parse an already-loaded `config.json` dict (and optional generation config dict)."""
        architecture = _architecture(raw)
        common = _common_fields(raw)
        traits = ARCHITECTURES[architecture](raw, common["num_layers"])
        tokens = _special_tokens(raw, generation or {})
        return cls(architecture=architecture, **common, **traits, **tokens)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _architecture(raw: Mapping[str, Any]) -> str:
    names = raw.get("architectures") or [_MODEL_TYPES.get(str(raw.get("model_type")), raw.get("model_type"))]
    known = [name for name in names if name in ARCHITECTURES]
    if not known:
        raise UnsupportedModel(
            f"unsupported architecture {names!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return str(known[0])


def _require(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise CheckpointError(f"config.json: missing required key {key!r}")
    return raw[key]


def _common_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    partial = raw.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UnsupportedModel(f"config.json: partial_rotary_factor {partial} is not supported (only 1.0)")
    heads = int(_require(raw, "num_attention_heads"))
    hidden = int(_require(raw, "hidden_size"))
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return {
        "vocab_size": int(_require(raw, "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_require(raw, "intermediate_size")),
        "num_layers": int(_require(raw, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(raw.get("rope_theta", 10000.0)),
        "rope_scaling": parse_rope_scaling(raw.get("rope_scaling")),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "torch_dtype": str(dtype) if dtype else None,
    }


_ROPE_KEYS: dict[RopeKind, tuple[set[str], set[str]]] = {
    # kind: (required keys, optional keys) besides rope_type/type
    RopeKind.DEFAULT: (set(), set()),
    RopeKind.LINEAR: ({"factor"}, set()),
    RopeKind.DYNAMIC: ({"factor"}, {"original_max_position_embeddings"}),
    RopeKind.LLAMA3: (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        set(),
    ),
    RopeKind.YARN: (
        {"factor"},
        {
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "original_max_position_embeddings",
            "truncate",
        },
    ),
}


def parse_rope_scaling(raw: Mapping[str, Any] | None) -> RopeScaling:
    """Parse `rope_scaling`; a type we cannot reproduce exactly is refused by name."""
    if not raw:
        return RopeScaling()
    name = raw.get("rope_type", raw.get("type", "default"))
    try:
        kind = RopeKind(name)
    except ValueError:
        supported = ", ".join(k.value for k in RopeKind)
        raise UnsupportedModel(
            f"rope_scaling type {name!r} is not supported (supported: {supported})"
        ) from None
    required, optional = _ROPE_KEYS[kind]
    missing = sorted(key for key in required if raw.get(key) is None)
    if missing:
        raise CheckpointError(f"rope_scaling {kind.value!r} is missing {', '.join(missing)}")
    values = {key: raw[key] for key in required | optional if raw.get(key) is not None}
    if "factor" in values and (not math.isfinite(values["factor"]) or values["factor"] < 1.0):
        raise CheckpointError(f"rope_scaling factor must be >= 1, got {values['factor']}")
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
    return RopeScaling(kind=kind, **values)


def _llama_traits(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(raw.get("mlp_bias", False))}


def _mistral_traits(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


def _qwen2_traits(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    traits: dict[str, Any] = {"qkv_bias": True}
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    if not window:
        return traits
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first_sliding = int(raw.get("max_window_layers", 28))
        layer_types = [
            "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
        ]
    unknown = sorted({t for t in layer_types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        raise UnsupportedModel(f"config.json: layer type(s) {unknown} not supported")
    traits["sliding_window"] = int(window)
    traits["sliding_layers"] = tuple(t == "sliding_attention" for t in layer_types)
    return traits


# architectures entry -> parser of the architecture's own flags. The math is one module family.
ARCHITECTURES: dict[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama_traits,
    "MistralForCausalLM": _mistral_traits,
    "Qwen2ForCausalLM": _qwen2_traits,
}


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _special_tokens(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> dict[str, Any]:
    # generate() takes EOS/BOS from generation_config.json when present, so it wins here too.
    eos = _ids(generation.get("eos_token_id")) or _ids(raw.get("eos_token_id"))
    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    return {"eos_token_ids": eos, "bos_token_id": int(bos) if bos is not None else None}
