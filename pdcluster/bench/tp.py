"""`pdcluster bench tp`: a decode step of a tensor-parallel group (`--tp`, default 2) against one
process (tp 1) on the same model, in one run, and the collectives' share of a tp step.

Both run the model runner directly (no gRPC): `--batch` sequences of `--prompt-tokens` random tokens
are prefilled, then `--decode-steps` greedy decode steps are timed (mean seconds per step). The
variants are interleaved `--repeats` times after a warm-up round: `tp1` uses every core given to
torch (`--threads`), `tp1_rank_threads` one rank's share of them, and each rank of the group its
share (one process per rank, CPU slices). On a shared machine several intra-op threads of one
process can cost more than they give; the second baseline shows how much.
The collectives' share comes from one more profiled tp run (torch.profiler on rank 0: the time
inside all-reduce and all-gather over the step time; rank 0 waits there for the slowest rank too).
Unset `--model` builds the 54 M-parameter Llama of PEERS.md (`--quick`: the 2-layer tiny one).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from pdcluster.bench.models import model_or_built

COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather")


@dataclass(frozen=True)
class BenchTpConfig:
    """Options of the tensor-parallel benchmark."""

    json: Path | None = field(default=None, metadata={"help": "write the results as JSON to this file"})
    model: Path | None = field(
        default=None, metadata={"help": "checkpoint folder; unset = the 54 M-parameter Llama of PEERS.md"}
    )
    quick: bool = field(default=False, metadata={"help": "unset --model: the 2-layer tiny Llama instead"})
    tp: int = field(default=2, metadata={"help": "ranks of the group compared with one process"})
    batch: int = field(default=8, metadata={"help": "sequences in the decode batch"})
    prompt_tokens: int = field(default=64, metadata={"help": "prompt length of every sequence"})
    decode_steps: int = field(default=16, metadata={"help": "decode steps timed per run"})
    repeats: int = field(default=3, metadata={"help": "timed runs per variant"})
    block_size: int = field(default=16, metadata={"help": "KV page size"})
    threads: int = field(default=0, metadata={"help": "CPU cores for torch in all (0 = os.cpu_count())"})

    def __post_init__(self) -> None:
        if self.tp < 2:
            raise ValueError(f"--tp must be at least 2, got {self.tp}")
        if min(self.batch, self.prompt_tokens, self.decode_steps, self.repeats, self.block_size) <= 0:
            raise ValueError("batch, prompt tokens, steps, repeats and block size must be positive")


def _pages_per_seq(config: BenchTpConfig) -> int:
    return -(-(config.prompt_tokens + config.decode_steps + 1) // config.block_size)


def _step_seconds(runner: Any, config: BenchTpConfig, prompts: list[list[int]]) -> float:
    """Prefill `prompts`, then the mean seconds of one greedy decode step of all of them."""
    from replica.engine.backend import SeqInput

    per = _pages_per_seq(config)
    pages = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    out = runner.forward([SeqInput(p, pages[i], 0) for i, p in enumerate(prompts)])
    length = config.prompt_tokens
    start = time.perf_counter()
    for _ in range(config.decode_steps):
        tokens = out.last_logits.argmax(-1).tolist()
        out = runner.forward([SeqInput([t], pages[i], length) for i, t in enumerate(tokens)])
        length += 1
    return (time.perf_counter() - start) / config.decode_steps


def _collective_share(runner: Any, config: BenchTpConfig, prompts: list[list[int]]) -> dict[str, float]:
    """One profiled tp run: seconds per step inside collectives on rank 0, and their share of it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step = _step_seconds(runner, config, prompts)
    inside_us = sum(e.cpu_time_total for e in prof.key_averages()
                    if any(name in e.key.lower() for name in COLLECTIVES) and "::" in e.key)
    # prefill's collectives are in the total too: spread over prefill + steps, an upper bound per step
    per_step = inside_us / 1e6 / (config.decode_steps + 1)
    return {"profiled_step_ms": step * 1e3, "collectives_ms": per_step * 1e3, "share": per_step / step}


def measure(config: BenchTpConfig, model: Path) -> dict[str, Any]:
    """Interleaved runs of tp 1 and tp N on `model`; step times in seconds per run."""
    import os

    import torch

    from replica.engine.runner import ModelRunner
    from replica.model.attention import PagedKVCache
    from replica.model.llama import load_model
    from replica.tp.leader import start_group
    from replica.tp.rank import RankSpec

    threads = config.threads or os.cpu_count() or 1
    blocks = _pages_per_seq(config) * config.batch
    rng = random.Random(0)
    loaded = load_model(model, torch.float32)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(config.prompt_tokens)] for _ in range(config.batch)]
    cache = PagedKVCache.for_model(loaded.config, blocks, config.block_size, torch.float32)
    single = ModelRunner(loaded.model, cache)
    leader = start_group(RankSpec(model, torch.float32, blocks, config.block_size), config.tp,
                         torch.device("cpu"))
    try:
        per_rank = max(1, threads // config.tp)
        variants = {"tp1": (single, threads), "tp1_rank_threads": (single, per_rank),
                    f"tp{config.tp}": (leader.runner, per_rank)}
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(config.repeats + 1):  # round 0 warms up
            for name, (runner, count) in variants.items():
                torch.set_num_threads(count)
                seconds = _step_seconds(runner, config, prompts)
                if repeat:
                    runs[name].append(seconds)
        share = _collective_share(leader.runner, config, prompts)
    finally:
        leader.stop()
    return {"runs_s": runs, "collectives": share}


def report(config: BenchTpConfig, measured: dict[str, Any], name: str) -> dict[str, Any]:
    """Best and median ms per step of each variant and the ratios tp N / tp 1."""
    runs = measured["runs_s"]
    step = {k: {"best": min(v) * 1e3, "median": median(v) * 1e3} for k, v in runs.items()}
    many = f"tp{config.tp}"
    return {
        "model": name, "tp": config.tp, "batch": config.batch, "prompt_tokens": config.prompt_tokens,
        "decode_steps": config.decode_steps, "repeats": config.repeats, "step_ms": step,
        "ratio_best": step[many]["best"] / step["tp1"]["best"],
        "ratio_median": step[many]["median"] / step["tp1"]["median"],
        "ratio_to_rank_threads_best": step[many]["best"] / step["tp1_rank_threads"]["best"],
        "ratio_to_rank_threads_median": step[many]["median"] / step["tp1_rank_threads"]["median"],
        "collectives": measured["collectives"],
    }


def run(config: BenchTpConfig) -> int:
    """Build (or take) the model, measure, print, write JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model, name = model_or_built(config.model, config.quick, Path(tmp))
        out = report(config, measure(config, model), name)
    for variant, step in out["step_ms"].items():
        print(f"{variant:<16} {step['best']:8.2f} ms/step best, {step['median']:8.2f} median")
    c = out["collectives"]
    print(f"tp{config.tp} / tp1: {out['ratio_best']:.3f} best, {out['ratio_median']:.3f} median; / tp1 on "
          f"one rank's threads: {out['ratio_to_rank_threads_best']:.3f} best, "
          f"{out['ratio_to_rank_threads_median']:.3f} median; "
          f"collectives {c['collectives_ms']:.2f} ms of a {c['profiled_step_ms']:.2f} ms profiled step "
          f"({c['share']:.0%})")
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(out, indent=2))
    return 0
