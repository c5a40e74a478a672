"""Brief next-token training of a tiny checkpoint on the built-in English text (`--train-steps`).

    corpus text ──tokenizer──▶ windows: <s> + seq_len tokens from every word start (wrapping around)
                                   │ random batches (seeded)
    transformers *ForCausalLM ◀────┘ AdamW, linear warm-up then cosine decay, until steps or seconds run out
              │
              └──▶ float32 tensors by Hugging Face name (tiny_model encodes and writes them)

A tiny model memorises the corpus: greedy continuations of prompts taken from it ("Once upon a time")
then read as English, which is all a demo needs. Training starts from transformers' own seeded
initialisation, so a config and step count give the same weights on one machine, unless the seconds
cap stops it early. Each window starts with <s> because the replica tokenizes prompts with <s> first.
transformers (a dev dependency) is imported only here, lazily, with a clear error when it is missing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Log = Callable[[str], None]
LOG_EVERY = 50  # steps between progress lines
MAX_THREADS = 1  # see _few_threads


@dataclass(frozen=True)
class TrainSettings:
    """How long and how fast to train."""

    steps: int
    seconds: float = 0.0  # wall-clock cap; 0: none
    lr: float = 3e-3
    seed: int = 0
    seq_len: int = 48  # tokens per window after <s>: a prompt plus a demo-sized answer
    batch: int = 8  # windows per step: small steps, many of them, memorise fastest per second

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.seq_len <= 0 or self.batch <= 0:
            raise ValueError("steps, seq_len and batch must be positive")
        if self.seconds < 0 or self.lr <= 0:
            raise ValueError("seconds must be >= 0 and lr > 0")


@dataclass(frozen=True)
class TrainReport:
    """What a training run did (losses are means over the first and the last logging interval)."""

    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    stopped_by_time: bool


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(
            "training a tiny model needs transformers (the dev extra: pip install -e '.[dev]')"
        ) from exc
    return transformers


def corpus_text(corpus: str) -> str:
    """The corpus as one line: single spaces, so the model never learns stray line breaks."""
    return " ".join(corpus.split())


def corpus_windows(tokenizer: Any, text: str, seq_len: int, bos_id: int) -> torch.Tensor:
    """(word starts, 1 + seq_len) token ids: <s>, then the text from that word on (wrapping around).

    `tokenizer` is a `tokenizers.Tokenizer`. Every window tokenizes a span that starts at a word, as
    a prompt would, and is cut to `seq_len` tokens well before the span ends, so no cut word leaks in.
    """
    starts = [0] + [i + 1 for i, char in enumerate(text) if char == " "]
    span = 16 * seq_len  # characters: far more than seq_len tokens (every token holds >= 1 character)
    looped = (text + " ") * (2 + span // len(text))
    encodings = tokenizer.encode_batch([looped[s : s + span] for s in starts], add_special_tokens=False)
    rows = [[bos_id, *encoding.ids[:seq_len]] for encoding in encodings]
    return torch.tensor(rows, dtype=torch.long)


def initial_model(hf_config: dict[str, Any], seed: int) -> Any:
    """A float32 transformers model for `hf_config` (config.json contents), seeded initialisation."""
    transformers = _import_transformers()
    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    fields["torch_dtype"] = "float32"  # train in float32 whatever the checkpoint dtype
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


@torch.no_grad()
def mean_loss(model: Any, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token cross-entropy of `model` over all `windows`."""
    model.eval()
    losses = [
        float(model(input_ids=part, labels=part, use_cache=False).loss) * len(part)
        for part in windows.split(batch)
    ]
    return sum(losses) / len(windows)


@contextmanager
def _few_threads() -> Iterator[None]:
    """One torch thread while training: on a small shared machine a second thread mostly waits for a
    busy core (measured: 2 threads ran 2-7x slower per step than 1 under load), and tiny matrices gain
    little from it anyway."""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, MAX_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10% of the steps (at most 30), then cosine decay to 10%."""
    warmup = max(1, min(30, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def train_causal_lm(
    model: Any, windows: torch.Tensor, settings: TrainSettings, log: Log | None = None
) -> TrainReport:
    """Train `model` in place on random batches of `windows`; stop after the steps or the seconds cap."""
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, settings.steps))
    losses: list[float] = []
    start = time.monotonic()
    stopped_by_time = False
    model.train()
    with _few_threads():
        for step in range(settings.steps):
            if settings.seconds and time.monotonic() - start > settings.seconds:
                stopped_by_time = True
                break
            rows = windows[torch.randint(len(windows), (settings.batch,), generator=generator)]
            loss = model(input_ids=rows, labels=rows, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if log and (step + 1) % LOG_EVERY == 0:
                log(f"  step {step + 1}/{settings.steps}: loss {np.mean(losses[-LOG_EVERY:]):.3f}")
    model.eval()
    return _report(losses, time.monotonic() - start, stopped_by_time)


def _report(losses: list[float], seconds: float, stopped_by_time: bool) -> TrainReport:
    window = max(1, min(LOG_EVERY, len(losses) // 4))
    first = float(np.mean(losses[:window])) if losses else math.nan
    last = float(np.mean(losses[-window:])) if losses else math.nan
    return TrainReport(len(losses), seconds, first, last, stopped_by_time)


def train_on_corpus(
    hf_config: dict[str, Any], tokenizer: Any, corpus: str, settings: TrainSettings, log: Log | None = None
) -> tuple[dict[str, np.ndarray], TrainReport]:
    """Train a fresh model for `hf_config` on `corpus`; its float32 tensors by HF name and the report."""
    with _few_threads():
        model = initial_model(hf_config, settings.seed)
    windows = corpus_windows(tokenizer, corpus_text(corpus), settings.seq_len, hf_config["bos_token_id"])
    report = train_causal_lm(model, windows, settings, log)
    if log:
        cut = " (stopped by the time cap)" if report.stopped_by_time else ""
        log(f"  trained {report.steps} steps in {report.seconds:.1f} s{cut}: "
            f"loss {report.first_loss:.3f} -> {report.last_loss:.3f}")
    tensors = {name: t.detach().float().contiguous().numpy() for name, t in model.state_dict().items()}
    return tensors, report
