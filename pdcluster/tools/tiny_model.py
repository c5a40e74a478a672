"""`pdcluster make-tiny-model`: a tiny Hugging Face checkpoint with a locally trained tokenizer.

The folder (config.json, generation_config.json, model.safetensors or shards + index,
tokenizer.json, tokenizer_config.json, special_tokens_map.json) loads as-is with
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`, so tests
can compare our replica with transformers on it. Nothing is downloaded. Weights are made with numpy
and written by a small safetensors writer (no torch import: the command runs in well under a
second); tokenizers is imported only when a model is made, so `--help` stays fast.

Weights are random by default. With `--train-steps N` the model is instead trained briefly on the
built-in English text (`CORPUS` + `STORIES`, see pdcluster/tools/tiny_train.py: torch and transformers,
imported only then), so greedy continuations of prompts from that text read as English. The folder
layout and the tokenizer (always learnt from `CORPUS` alone) are the same either way.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
# Renders tools (a system turn listing them) and earlier tool calls in the Hermes style the router
# parses (router/http/tools.py); without tools or calls the prompt is what it always was.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    'To call one, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ eos_token }}{{ \'\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# A small English corpus, enough for a few hundred byte-level BPE merges.
CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a little town by the sea, and every morning the fishermen sailed out
before the sun came up. The children ran along the beach, looking for shells and small crabs.
In the evening the families gathered around the fire and told stories about the old days.
What is the capital of France? The capital of France is Paris. What is two plus two? It is four.
Hello, how are you today? I am fine, thank you. Please tell me a story about a dragon and a knight.
The weather today is sunny with a light breeze from the west, and tomorrow it will rain.
Machine learning models learn patterns from data. Large language models predict the next token.
A server receives requests, batches them together, and sends the results back to the clients.
The cat sat on the mat while the dog slept in the garden under the tall green tree.
Water boils at one hundred degrees and freezes at zero. The moon moves around the earth.
She opened the door, looked outside, and decided that it was a good day for a long walk.
Numbers: one two three four five six seven eight nine ten eleven twelve twenty thirty hundred.
Questions and answers, stories and poems, letters and lists: all of them are made of words.
"""
# More plain English for `--train-steps` only (the tokenizer is learnt from CORPUS alone, so the
# default checkpoints stay exactly as they were).
STORIES = """
The old lighthouse keeper lived at the end of the harbour. Every night he climbed the stairs, lit
the great lamp, and watched the ships find their way home through the dark water. When the storm
came in the winter, he did not sleep at all, and in the morning the whole town thanked him.
A little girl named Mia found a lost puppy under the bridge. She carried it home in her coat, gave
it warm milk, and called it Pepper. From that day on, Pepper followed her everywhere: to school, to
the market, and down to the beach to look for shells.
The prefill replica reads the whole prompt at once and fills the cache with keys and values. Then
the cache moves to the decode replica, which writes the answer one token at a time, while the
router sends each new request to the replica with the most free room.
In the spring the farmers planted wheat and corn in the fields beyond the hill. The rain fell
softly, the sun grew warm, and by the end of the summer the fields were tall and golden.
"""


@dataclass
class TinyModelConfig:
    """Shape and contents of the tiny checkpoint."""

    out: Path = field(metadata={"help": "output folder (created if missing)", "positional": True})
    arch: str = field(default="llama", metadata={"help": "architecture", "choices": sorted(ARCHS)})
    layers: int = field(default=2, metadata={"help": "number of decoder layers"})
    hidden: int = field(default=64, metadata={"help": "hidden size"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    kv_heads: int = field(default=2, metadata={"help": "key/value heads (grouped-query attention)"})
    intermediate: int = field(default=128, metadata={"help": "MLP intermediate size"})
    vocab: int = field(default=512, metadata={"help": "vocabulary size (>= the tokenizer's, >= 300)"})
    seed: int = field(default=0, metadata={"help": "random seed of the weights"})
    max_positions: int = field(default=512, metadata={"help": "max_position_embeddings"})
    tie_embeddings: bool = field(default=False, metadata={"help": "tie lm_head to the embedding"})
    dtype: str = field(
        default="float32", metadata={"help": "weight dtype", "choices": ["float32", "bfloat16", "float16"]}
    )
    shards: int = field(default=1, metadata={"help": "number of safetensors files (>1 writes an index)"})
    head_dim: int = field(default=0, metadata={"help": "explicit head_dim (0: hidden / heads, key omitted)"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base"})
    rope_scaling: str = field(
        default="", metadata={"help": "rope_scaling as JSON (e.g. a llama3 dict); empty: none"}
    )
    sliding_window: int = field(default=0, metadata={"help": "sliding window (mistral/qwen2); 0: none"})
    attention_bias: bool = field(default=False, metadata={"help": "llama: biases on q/k/v/o"})
    mlp_bias: bool = field(default=False, metadata={"help": "llama: biases on the MLP"})
    train_steps: int = field(
        default=0, metadata={"help": "train on the built-in English text for N steps; 0: random weights"}
    )
    train_seconds: float = field(
        default=60.0, metadata={"help": "stop training after this many seconds (0: no limit)"}
    )
    train_lr: float = field(default=3e-3, metadata={"help": "peak learning rate of the training"})

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        if self.vocab < 300:
            raise ValueError(f"vocab must be >= 300 (256 bytes + special tokens + merges), got {self.vocab}")
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.shards) <= 0:
            raise ValueError("layers, hidden, heads, kv_heads, intermediate and shards must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.train_steps < 0 or self.train_seconds < 0 or self.train_lr <= 0:
            raise ValueError("train_steps and train_seconds must be >= 0 and train_lr > 0")
        if self.rope_scaling:
            self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        from replica.errors import InvalidArgument
        from replica.model.config import parse_rope_scaling

        try:
            scaling = json.loads(self.rope_scaling)
        except json.JSONDecodeError as exc:
            raise ValueError(f"rope_scaling is not valid JSON: {exc}") from exc
        if not isinstance(scaling, dict):
            raise ValueError("rope_scaling must be a JSON object")
        try:
            parse_rope_scaling(scaling)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from exc


def hf_config(cfg: TinyModelConfig) -> dict[str, Any]:
    """The config.json contents."""
    architecture, model_type = ARCHS[cfg.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": json.loads(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.dtype,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
    }
    if cfg.head_dim:
        config["head_dim"] = cfg.head_dim
    if cfg.arch == "llama":
        config.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.arch == "mistral":
        config["sliding_window"] = cfg.sliding_window or None
    else:
        window = cfg.sliding_window or None
        config.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
    return config


# safetensors dtype tag of each weight dtype (bfloat16 is stored as raw uint16 words)
_TAGS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as little-endian words of `dtype` (bfloat16: round to nearest even, as torch does)."""
    if dtype == "bfloat16":
        bits = values.astype("<f4").view("<u4")
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype("<u2")
    return values.astype("<f4" if dtype == "float32" else "<f2")


def _layout_shapes(cfg: TinyModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the checkpoint holds, by HF name, in file order."""
    from replica.model.config import ModelConfig
    from replica.model.layout import WeightLayout

    layout = WeightLayout.for_config(ModelConfig.from_dict(hf_config(cfg)), "float32")
    return {name: spec.shape for name, spec in layout.tensors().items()}


def _random_weights(cfg: TinyModelConfig) -> dict[str, np.ndarray]:
    """Random tensors by HF name, already encoded in the checkpoint dtype (numpy only: no torch import)."""
    rng = np.random.default_rng(cfg.seed)
    tensors = {}
    for name, shape in _layout_shapes(cfg).items():
        noise = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            # around 1 but not exactly, so a missing or misplaced norm weight changes the logits
            values = 1.0 + 0.1 * noise
        else:
            std = 0.1 if name.endswith(("embed_tokens.weight", "lm_head.weight", "bias")) else 0.08
            values = std * noise
        tensors[name] = _encode(values, cfg.dtype)
    return tensors


def _trained_weights(cfg: TinyModelConfig, log: Callable[[str], None] | None) -> dict[str, np.ndarray]:
    """Tensors of a model trained on CORPUS + STORIES, by HF name, encoded in the checkpoint dtype."""
    from pdcluster.tools.tiny_train import TrainSettings, train_on_corpus

    settings = TrainSettings(steps=cfg.train_steps, seconds=cfg.train_seconds, lr=cfg.train_lr, seed=cfg.seed)
    trained, _ = train_on_corpus(hf_config(cfg), _train_tokenizer(cfg.vocab), CORPUS + STORIES, settings, log)
    tensors = {}
    for name, shape in _layout_shapes(cfg).items():
        if trained[name].shape != shape:
            raise ValueError(f"trained {name} has shape {trained[name].shape}, the layout says {shape}")
        tensors[name] = _encode(trained[name], cfg.dtype)
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """One safetensors file: u64 header length, JSON header (space-padded to 8 bytes), packed data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": _TAGS[dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for array in tensors.values():
            out.write(np.ascontiguousarray(array).tobytes())


def _save_weights(cfg: TinyModelConfig, tensors: dict[str, np.ndarray]) -> None:
    names = list(tensors)
    if cfg.shards == 1:
        write_safetensors(cfg.out / "model.safetensors", tensors, cfg.dtype)
        return
    shards = min(cfg.shards, len(names))
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        write_safetensors(cfg.out / file, part, cfg.dtype)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (cfg.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _train_tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line for line in CORPUS.splitlines() if line], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def _write_tokenizer(cfg: TinyModelConfig) -> None:
    tokenizer = _train_tokenizer(cfg.vocab)
    if tokenizer.get_vocab_size() > cfg.vocab:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab={cfg.vocab}")
    tokenizer.save(str(cfg.out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg.max_positions,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(cfg.out / "tokenizer_config.json", tokenizer_config)
    _write_json(cfg.out / "special_tokens_map.json", special)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def make_tiny_model(config: TinyModelConfig, log: Callable[[str], None] | None = None) -> Path:
    """Write the checkpoint folder described by `config` and return it (`log` gets training progress)."""
    config.out.mkdir(parents=True, exist_ok=True)
    _write_json(config.out / "config.json", hf_config(config))
    _write_json(
        config.out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    )
    tensors = _trained_weights(config, log) if config.train_steps else _random_weights(config)
    _save_weights(config, tensors)
    _write_tokenizer(config)
    return config.out


def run(config: TinyModelConfig) -> int:
    """CLI runner: make the checkpoint (training progress on stdout) and print its folder."""
    print(make_tiny_model(config, log=lambda line: print(line, flush=True)))
    return 0
