"""`make-tiny-model --train-steps`: a briefly trained checkpoint that learnt, loads, and serves alike.

One short training of the default (test-sized) shape through the CLI, then: the saved weights have a
clearly lower loss on the built-in text than the seeded initialisation training started from; the
folder has the same files, tensors and tokenizer as a random-weight one; transformers loads it; and
our model's greedy continuation of a prompt from the text is transformers' token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.cli import main as cli_main
from pdcluster.tools.tiny_model import CORPUS, STORIES, TinyModelConfig, hf_config
from pdcluster.tools.tiny_train import corpus_text, corpus_windows, initial_model, mean_loss
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.llama import load_model

transformers = pytest.importorskip("transformers")

STEPS = 60
PROMPT = "Once upon a time"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-trained")
    assert cli_main(["make-tiny-model", str(out), "--train-steps", str(STEPS), "--train-lr", "3e-3"]) == 0
    return out


def _windows(path: Path) -> torch.Tensor:
    """Every 4th training window (enough to measure the loss, a quarter of the time)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = corpus_text(CORPUS + STORIES)
    return corpus_windows(tokenizer.backend_tokenizer, text, 48, tokenizer.bos_token_id)[::4]


def test_training_lowers_the_loss_and_transformers_loads_it(trained: Path) -> None:
    windows = _windows(trained)
    start = mean_loss(initial_model(hf_config(TinyModelConfig(out=trained)), seed=0), windows)
    model = transformers.AutoModelForCausalLM.from_pretrained(trained)
    assert type(model).__name__ == "LlamaForCausalLM"
    end = mean_loss(model, windows)
    assert end < start - 1.0, (start, end)


def test_same_layout_and_tokenizer_as_random_weights(trained: Path, tiny_llama: Path) -> None:
    assert sorted(p.name for p in trained.iterdir()) == sorted(p.name for p in tiny_llama.iterdir())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (trained / name).read_bytes() == (tiny_llama / name).read_bytes(), name
    header = _safetensors_header(trained / "model.safetensors")
    assert header == _safetensors_header(tiny_llama / "model.safetensors")


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return dict(json.loads(f.read(size)))


def _our_greedy(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with our model, one token per step on a paged KV cache."""
    loaded = load_model(path, torch.float32)
    cache = PagedKVCache.for_model(loaded.config, 16, 4, torch.float32)
    tokens, done = list(prompt), 0
    for _ in range(new_tokens):
        seq = SeqSlice(tuple(range(16)), done, len(tokens) - done)
        ctx = AttentionContext.build(cache, [seq], loaded.config)
        logits = loaded.model.head(loaded.model(torch.tensor(tokens[done:]), ctx))
        done = len(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


def test_our_greedy_continuation_is_transformers(trained: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained)
    prompt = tokenizer(PROMPT).input_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = ref[0, len(prompt) :].tolist()
    assert _our_greedy(trained, prompt, NEW_TOKENS) == expected
