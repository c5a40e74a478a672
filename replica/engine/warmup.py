"""Warmup: the profile run (the largest prefill the limits allow) and sizing the KV cache from memory.

Pure Python: the runner runs the profile prefill and makes the resized cache (`backend.Runner`).

When `--num-blocks` is not given, the cache gets `fraction` of the memory left: at start-up from the
memory available then, and again at Warmup from the memory left after the profile run (the cache's
own bytes count as left, so repeated warmups do not shrink it). On CUDA the cache keeps the size the
factory gave it (from `--gpu-memory-fraction` after a profile run); the factory captures the decode
CUDA graphs (`--cuda-graphs`) at start, and Warmup captures them again if the runner lost them.
"""

from __future__ import annotations

from collections.abc import Sequence

from replica.engine.backend import SeqInput
from replica.engine.engine import Engine
from replica.engine.types import WarmupSpec
from replica.errors import ResourceExhausted

# The largest decode batch replayed from a CUDA graph; larger steps run eagerly (their launches
# are a small share of their time).
MAX_GRAPH_BATCH = 256


def check_limits(engine: Engine, spec: WarmupSpec) -> int:
    """Refuse limits larger than this replica's; returns the profile run's prompt tokens."""
    limits = engine.limits
    asked = {
        "max_input_length": (spec.max_input_tokens, limits.max_input_tokens),
        "max_total_tokens": (spec.max_total_tokens, limits.max_total_tokens),
        "max_prefill_tokens": (spec.max_prefill_tokens, limits.max_prefill_tokens),
    }
    for name, (value, ours) in asked.items():
        if value is not None and value > ours:
            raise ResourceExhausted(f"warmup {name}={value} is over this replica's limit {ours}")
    return spec.max_prefill_tokens or limits.max_prefill_tokens


def profile_lengths(prefill_tokens: int, per_seq: int) -> list[int]:
    """Prompt lengths of a profile run of `prefill_tokens` tokens, none longer than `per_seq`."""
    rest = prefill_tokens % per_seq
    return [per_seq] * (prefill_tokens // per_seq) + ([rest] if rest else [])


def profile_inputs(lengths: Sequence[int], pages: Sequence[Sequence[int]], vocab: int) -> list[SeqInput]:
    """Fresh prompts of `lengths` into `pages` (token ids spread over the vocabulary)."""
    return [
        SeqInput([(7 * i + j) % vocab for j in range(n)], p, 0)
        for i, (n, p) in enumerate(zip(lengths, pages, strict=True))
    ]


def profile_run(engine: Engine, prefill_tokens: int) -> int:
    """Run a prefill of up to `prefill_tokens` tokens (what fits in the free pages), then free them."""
    fits = engine.blocks.num_free * engine.block_size
    total = min(prefill_tokens, fits)
    lengths = profile_lengths(total, engine.limits.max_input_tokens)
    if not lengths:
        return 0
    pages = engine.blocks.allocate_many([engine.blocks.pages_for(n) for n in lengths])
    try:
        engine.runner.forward(profile_inputs(lengths, pages, engine.limits.vocab_size))
    finally:
        engine.blocks.free([p for ps in pages for p in ps])
    return total


def resize_from_memory(engine: Engine, fraction: float) -> None:
    """Give the KV cache `fraction` of the memory left (no-op while batches are cached, or for a
    runner whose cache does not follow the memory left, like the simulated GPU's)."""
    if len(engine.store):
        return
    runner = engine.runner.resized(fraction)
    if runner is not None:
        engine.replace_cache(runner)


def warmup(engine: Engine, spec: WarmupSpec, auto_size_fraction: float | None) -> int:
    """The Warmup RPC: profile run, optional cache sizing, returns the tokens the cache holds."""
    tokens = check_limits(engine, spec)
    if spec.batch is not None:
        result = engine.prefill(spec.batch)
        if result.batch is not None:
            engine.clear(result.batch.id)
    else:
        profile_run(engine, tokens)
    if auto_size_fraction is not None:
        resize_from_memory(engine, auto_size_fraction)
    if engine.meta.cuda_graphs and not engine.runner.graph_buckets and not len(engine.store):
        # the capture's dummy row writes one slot of page 0: only while no batch holds pages
        engine.runner.capture_graphs(min(MAX_GRAPH_BATCH, engine.blocks.num_blocks))
    return engine.blocks.num_blocks * engine.block_size
