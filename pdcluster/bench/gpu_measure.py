"""The measurements of `pdcluster bench gpu` (torch): the device's copy bandwidth and matmul rate, a
random-weight model straight in device memory, decode steps over a randomly filled paged cache,
prefills, and a profiler table. Each timing is the best of a few runs after a warm-up, with the
device synchronised around it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pdcluster.bench.gpu_roofline import ModelShape, matmul_flops, pages_per_sequence
from replica.engine.backend import SeqInput
from replica.engine.runner import ModelRunner
from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.model.llama import CausalLM, build_model, load_model
from replica.model.weights import dtype_name, tensor_views


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the best run's and the median run's."""

    best: float
    median: float

    def to_json(self) -> dict[str, float]:
        """For the report."""
        return {"best_s": self.best, "median_s": self.median}


def time_calls(fn: Callable[[], object], device: torch.device, calls: int, repeats: int, warmup: int = 1
               ) -> Timing:
    """Seconds per call of `fn`: `repeats` runs of `calls` back-to-back calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        runs.append((time.perf_counter() - start) / calls)
    return Timing(min(runs), statistics.median(runs))


# ------------------------------------------------------------------------------------ device limits
def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device `copy_` of `nbytes` (best of `repeats`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    timing = time_calls(partial(dst.copy_, src), device, calls=5, repeats=repeats, warmup=2)
    del src, dst
    return 2 * nbytes / timing.best


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an (n x n) @ (n x n) matmul in `dtype` (best of `repeats`)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    timing = time_calls(partial(torch.matmul, a, b, out=out), device, calls=5, repeats=repeats, warmup=2)
    del a, b, out
    return matmul_flops(n) / timing.best


# ------------------------------------------------------------------------------------------ model
def model_config(shape: ModelShape, max_positions: int) -> ModelConfig:
    """A Llama config of `shape`, accepting positions up to `max_positions` (RoPE table length)."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=shape.vocab, hidden_size=shape.hidden,
                       intermediate_size=shape.intermediate, num_layers=shape.layers, num_heads=shape.heads,
                       num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                       max_position_embeddings=max_positions, tie_word_embeddings=shape.tied_embeddings)


def shape_of(config: ModelConfig) -> ModelShape:
    """The dimensions of a checkpoint's config."""
    return ModelShape(hidden=config.hidden_size, layers=config.num_layers, heads=config.num_heads,
                      kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      intermediate=config.intermediate_size, vocab=config.vocab_size,
                      tied_embeddings=config.tie_word_embeddings)


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """The model over a weight buffer made on `device` and filled in place: N(0, 0.02) matrices, unit
    norms (no checkpoint, no host copy: a 7B model is ready in well under a second on a GPU)."""
    layout = WeightLayout.for_config(config, dtype_name(dtype))
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, view in tensor_views(layout, buffer).items():
            if name.endswith("norm.weight"):
                view.fill_(1.0)
            else:
                view.normal_(0.0, 0.02, generator=generator)
    return build_model(config, layout, buffer, dtype)


def checkpoint_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A checkpoint folder's model on `device`."""
    return load_model(path, dtype, str(device)).model


# ------------------------------------------------------------------------------------------ decode
def random_cache(config: ModelConfig, pages: int, block_size: int, dtype: torch.dtype, device: torch.device
                 ) -> PagedKVCache:
    """A paged cache of `pages` pages holding random K/V (no prefill: its tokens do not matter to a
    step's time, and prefilling 64 x 4 k tokens would cost more than the whole benchmark)."""
    cache = PagedKVCache.for_model(config, pages, block_size, dtype, str(device))
    cache.tensor.normal_(0.0, 1.0)
    return cache


def decode_inputs(batch: int, context: int, block_size: int, pages: int, vocab: int, seed: int = 0
                  ) -> list[SeqInput]:
    """One-token decode inputs of `batch` sequences, each attending to `context` tokens (the new one
    at position context - 1) in pages drawn at random from the cache's `pages` (as a busy cache
    scatters them)."""
    rng = random.Random(seed)
    ids = list(range(pages))
    rng.shuffle(ids)
    per = pages_per_sequence(context, block_size)
    if batch * per > pages:
        raise ValueError(f"{batch} x {per} pages needed, the cache has {pages}")
    return [SeqInput((rng.randrange(3, vocab),), tuple(ids[b * per:(b + 1) * per]), context - 1)
            for b in range(batch)]


def graph_runner(model: CausalLM, cache: PagedKVCache, backend: str, max_batch: int) -> ModelRunner | None:
    """A runner whose one-token decode steps up to `max_batch` rows replay captured CUDA graphs
    (None where none can be captured: the CPU, or an attention backend without graphs)."""
    runner = ModelRunner(model, cache, backend)
    return runner if runner.capture_graphs(max_batch) else None


def time_decode(runner: ModelRunner, seqs: Sequence[SeqInput], steps: int, repeats: int) -> Timing:
    """Seconds per decode step through `runner.forward` (the step rewrites the same slot each time)."""
    device = runner.device
    return time_calls(lambda: runner.forward(seqs), device, calls=steps, repeats=repeats, warmup=2)


# ----------------------------------------------------------------------------------------- prefill
def prefill_input(tokens: int, block_size: int, vocab: int, seed: int = 0) -> list[SeqInput]:
    """One fresh prompt of `tokens` random ids over pages 0.."""
    rng = random.Random(seed)
    ids = tuple(rng.randrange(3, vocab) for _ in range(tokens))
    return [SeqInput(ids, tuple(range(pages_per_sequence(tokens, block_size))), 0)]


def time_prefill(runner: ModelRunner, seqs: Sequence[SeqInput], repeats: int) -> Timing:
    """Seconds per prefill through `runner.forward`."""
    return time_calls(lambda: runner.forward(seqs), runner.device, calls=1, repeats=repeats, warmup=1)


# ----------------------------------------------------------------------------------------- profile
def profile_table(runner: ModelRunner, seqs: Sequence[SeqInput], steps: int, rows: int = 15
                  ) -> dict[str, Any]:
    """torch.profiler over `steps` decode steps: the top ops by self device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    device = runner.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    runner.forward(seqs)
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.forward(seqs)
        synchronize(device)
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:rows]
    return {
        "steps": steps,
        "sorted_by": key,
        "top": [{"name": e.key, "calls": e.count, f"{key}_us": float(getattr(e, key, 0.0))} for e in events],
        "table": prof.key_averages().table(sort_by=key, row_limit=rows),
    }
