"""The sequence of `pdcluster bench gpu`: limits, model, decode cells, prefill cells, profile; each
cell measured, skipped (with the arithmetic) or failed (with the error), printing progress as it goes.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.bench import gpu_measure as gm
from pdcluster.bench import gpu_roofline as rl
from replica.engine.device import choose_attention, resolve_device
from replica.engine.memory import available_memory_bytes
from replica.engine.runner import ModelRunner
from replica.model.attention import PagedKVCache
from replica.model.llama import CausalLM

if TYPE_CHECKING:
    from pdcluster.bench.gpu_config import BenchGpuConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LLAMA_2_POSITIONS = 4096
PROFILE_STEPS = 5


class _Clock:
    """Seconds since the run started, for the progress lines."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {text}", flush=True)


def free_bytes(device: torch.device) -> int:
    """Memory new tensors can take on `device` (CUDA: free, plus what torch's allocator holds unused)."""
    if device.type != "cuda":
        return available_memory_bytes(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str]:
    """fn's result and "", or None and why it failed (out of memory, a kernel error)."""
    try:
        return fn(), ""
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _model(config: BenchGpuConfig, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, str]:
    if config.model is not None:
        return gm.checkpoint_model(config.model, dtype, device), f"checkpoint {config.model}"
    positions = max(LLAMA_2_POSITIONS, *config.context_lengths, *config.prefill_lengths)
    shape = rl.SHAPES[config.shape]
    model = gm.random_model(gm.model_config(shape, positions), dtype, device)
    return model, f"random weights, {config.shape} shape"


# ------------------------------------------------------------------------------------------ decode
Measured = tuple[gm.Timing | None, gm.Timing | None, str]  # graphs, eager, why one failed


def _graphs(config: BenchGpuConfig, model: CausalLM, cache: PagedKVCache, backend: str, max_batch: int
            ) -> tuple[ModelRunner | None, str]:
    """The graph-replaying runner (None, and why, where there is none)."""
    if not config.cuda_graphs:
        return None, "off (--no-cuda-graphs)"
    runner, failed = _attempt(partial(gm.graph_runner, model, cache, backend, max_batch))
    if runner is None:
        where = cache.tensor.device.type
        return None, failed or f"none captured on {where} with the {backend} attention backend"
    return runner, f"captured for batches {list(runner.graph_buckets)}"


def _decode_context(config: BenchGpuConfig, model: CausalLM, backend: str, cells: list[rl.DecodeCell],
                    dtype: torch.dtype, device: torch.device, clock: _Clock
                    ) -> tuple[dict[int, Measured], str]:
    """(graphs, eager, failure) timings per batch of one context's fitting cells; what became of graphs."""
    context, largest = cells[0].context, max(c.batch for c in cells)
    pages = rl.cache_pages_per_context(cells)[context]
    clock.say(f"decode, context {context}: a cache of {pages} pages of random K/V, batches up to {largest}")
    cache = gm.random_cache(model.config, pages, config.block_size, dtype, device)
    eager = ModelRunner(model, cache, backend)
    graphs, note = _graphs(config, model, cache, backend, largest)
    clock.say(f"  CUDA graphs: {note}")
    out: dict[int, Measured] = {}
    for cell in cells:
        seqs = gm.decode_inputs(cell.batch, context, config.block_size, pages, model.config.vocab_size)
        steps, repeats = config.steps, config.repeats
        timed_graphs, failed = None, ""
        if graphs is not None:
            timed_graphs, failed = _attempt(partial(gm.time_decode, graphs, seqs, steps, repeats))
        timed, eager_failed = _attempt(partial(gm.time_decode, eager, seqs, steps, repeats))
        failed = failed or eager_failed
        out[cell.batch] = (timed_graphs, timed, failed)
        clock.say(f"  batch {cell.batch}: graphs {_ms(timed_graphs)}, eager {_ms(timed)} {failed}")
    del graphs, eager, cache
    _release(device)
    return out, note


def _ms(timing: gm.Timing | None) -> str:
    return "-" if timing is None else f"{timing.best * 1e3:.3f} ms"


def _timing_json(timing: gm.Timing | None, roofline: float) -> dict[str, float] | None:
    if timing is None:
        return None
    return {**timing.to_json(), "ratio": timing.best / roofline, "ratio_median": timing.median / roofline}


def _decode_row(cell: rl.DecodeCell, shape: rl.ModelShape, dtype_bytes: int, copy_bw: float,
                measured: Measured | None) -> dict[str, Any]:
    weights = rl.decode_weight_bytes(shape, dtype_bytes)
    kv = rl.decode_kv_bytes(shape, dtype_bytes, cell.batch, cell.context)
    roofline = rl.decode_roofline_s(shape, dtype_bytes, cell.batch, cell.context, copy_bw)
    graphs, eager, failed = measured if measured is not None else (None, None, "")
    status = "skipped" if not cell.fits else ("failed" if eager is None else "measured")
    return {"batch": cell.batch, "context": cell.context, "status": status, "reason": cell.reason or failed,
            "pages": cell.pages, "kv_cache_bytes": cell.kv_cache_bytes, "weight_bytes_read": weights,
            "kv_bytes_read": kv, "roofline_s": roofline, "graphs": _timing_json(graphs, roofline),
            "eager": _timing_json(eager, roofline)}


def _decode_cells(config: BenchGpuConfig, model: CausalLM, backend: str, cells: list[rl.DecodeCell],
                  dtype: torch.dtype, device: torch.device, clock: _Clock) -> tuple[dict[int, Measured], str]:
    """One context's fitting cells; when its cache (or anything around it) cannot be made, the
    largest batch is marked failed and the rest tried again (a tight fit must not cost batch 1)."""
    measured: dict[int, Measured] = {}
    remaining = sorted(cells, key=lambda c: c.batch)
    while remaining:
        attempt = partial(_decode_context, config, model, backend, remaining, dtype, device, clock)
        done, failed = _attempt(attempt)
        if done is not None:
            measured.update(done[0])
            return measured, done[1]
        clock.say(f"  batch {remaining[-1].batch} failed: {failed}")
        measured[remaining[-1].batch] = (None, None, failed)
        remaining = remaining[:-1]
        _release(device)
    return measured, ""


def _decode(config: BenchGpuConfig, model: CausalLM, backend: str, dtype: torch.dtype, device: torch.device,
            copy_bw: float, clock: _Clock) -> tuple[list[dict[str, Any]], str, int]:
    shape, dtype_bytes = gm.shape_of(model.config), _dtype_bytes(dtype)
    budget = free_bytes(device) - int(config.headroom_gib * rl.GIB)
    cells = rl.plan_decode(shape, dtype_bytes, config.block_size, config.batches, config.context_lengths,
                           budget, model.config.max_position_embeddings)
    rows: list[dict[str, Any]] = []
    graphs_note = ""
    for context in config.context_lengths:
        fitting = [c for c in cells if c.context == context and c.fits]
        measured: dict[int, Measured] = {}
        if fitting:
            measured, note = _decode_cells(config, model, backend, fitting, dtype, device, clock)
            graphs_note = graphs_note or note
        for cell in (c for c in cells if c.context == context):
            if not cell.fits:
                clock.say(f"decode batch {cell.batch} x context {context} skipped: {cell.reason}")
            rows.append(_decode_row(cell, shape, dtype_bytes, copy_bw, measured.get(cell.batch)))
    return rows, graphs_note, budget


# ----------------------------------------------------------------------------------------- prefill
def _prefill(config: BenchGpuConfig, model: CausalLM, backend: str, dtype: torch.dtype, device: torch.device,
             matmul_rate: float, clock: _Clock) -> list[dict[str, Any]]:
    shape = gm.shape_of(model.config)
    budget = free_bytes(device) - int(config.headroom_gib * rl.GIB)
    cells = rl.plan_prefill(shape, _dtype_bytes(dtype), config.block_size, config.prefill_lengths, budget,
                            model.config.max_position_embeddings)
    fitting = [c for c in cells if c.fits]
    timings: dict[int, tuple[gm.Timing | None, str]] = {}
    if fitting:
        cache = gm.random_cache(model.config, max(c.pages for c in fitting), config.block_size, dtype, device)
        runner = ModelRunner(model, cache, backend)
        for cell in fitting:
            seqs = gm.prefill_input(cell.tokens, config.block_size, model.config.vocab_size)
            timings[cell.tokens] = _attempt(partial(gm.time_prefill, runner, seqs, config.repeats))
            timing = timings[cell.tokens][0]
            clock.say(f"prefill {cell.tokens} tokens: "
                      f"{'-' if timing is None else f'{timing.best * 1e3:.2f} ms'} {timings[cell.tokens][1]}")
        del runner, cache
        _release(device)
    return [_prefill_row(c, shape, matmul_rate, timings.get(c.tokens)) for c in cells]


def _prefill_row(cell: rl.PrefillCell, shape: rl.ModelShape, matmul_rate: float,
                 measured: tuple[gm.Timing | None, str] | None) -> dict[str, Any]:
    flops = rl.prefill_flops(shape, cell.tokens)
    timing, failed = measured if measured is not None else (None, "")
    row: dict[str, Any] = {"tokens": cell.tokens, "status": "skipped" if not cell.fits else (
        "failed" if timing is None else "measured"), "reason": cell.reason or failed, "flops": flops}
    if timing is not None:
        rate = flops / timing.best
        row.update(timing.to_json(), tokens_per_s=cell.tokens / timing.best, flops_per_s=rate,
                   ratio=rate / matmul_rate, ratio_median=flops / timing.median / matmul_rate)
    return row


# ----------------------------------------------------------------------------------------- profile
def _profile(config: BenchGpuConfig, model: CausalLM, backend: str, dtype: torch.dtype, device: torch.device,
             clock: _Clock) -> dict[str, Any]:
    context = config.context_lengths[0]
    pages = rl.pages_per_sequence(context, config.block_size)
    clock.say(f"profile: batch 1, context {context}, {PROFILE_STEPS} steps")
    cache = gm.random_cache(model.config, pages, config.block_size, dtype, device)
    graphs, note = _graphs(config, model, cache, backend, 1)
    seqs = gm.decode_inputs(1, context, config.block_size, pages, model.config.vocab_size)
    eager = ModelRunner(model, cache, backend)
    out = {"batch": 1, "context": context, "eager": gm.profile_table(eager, seqs, PROFILE_STEPS),
           "graphs": None if graphs is None else gm.profile_table(graphs, seqs, PROFILE_STEPS),
           "graphs_note": note}
    del graphs, eager, cache
    _release(device)
    return out


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _device_json(device: torch.device, backend: str, graphs_note: str) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {"name": torch.cuda.get_device_name(device) if cuda else "cpu", "device": str(device),
            "torch": torch.__version__, "cuda": torch.version.cuda, "attention_backend": backend,
            "cuda_graphs": graphs_note,
            "total_memory_bytes": torch.cuda.mem_get_info(device)[1] if cuda else None}


def measure(config: BenchGpuConfig) -> dict[str, Any]:
    """Every measurement of the benchmark, as the report's sections (goals and config added by `run`)."""
    clock = _Clock()
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 runs measure the rate the device serves at
    dtype = DTYPES[config.dtype]
    clock.say(f"limits on {device}: copy_ of {config.copy_mib} MiB, {config.matmul_size}^3 {config.dtype} "
              "matmul")
    copy_bw = gm.copy_bandwidth(device, config.copy_mib << 20, config.repeats + 2)
    matmul = gm.matmul_rate(device, dtype, config.matmul_size, config.repeats + 2)
    clock.say(f"  copy {copy_bw / 1e9:.1f} GB/s, matmul {matmul / 1e12:.2f} TFLOP/s")
    model, source = _model(config, device, dtype)
    shape = gm.shape_of(model.config)
    backend = choose_attention(config.attention_backend, device)
    clock.say(f"model: {source}, {shape.params / 1e9:.2f} B matrix parameters, attention {backend}")
    decode, graphs_note, budget = _decode(config, model, backend, dtype, device, copy_bw, clock)
    prefill = _prefill(config, model, backend, dtype, device, matmul, clock)
    profile = _profile(config, model, backend, dtype, device, clock) if config.profile else None
    clock.say("done")
    return {
        "device": _device_json(device, backend, graphs_note),
        "model": {"source": source, "shape": asdict(shape), "matrix_params": shape.params,
                  "weight_bytes_read_per_decode_step": rl.decode_weight_bytes(shape, _dtype_bytes(dtype)),
                  "kv_bytes_per_token": shape.kv_bytes_per_token(_dtype_bytes(dtype))},
        "limits": {"copy_bytes_per_s": copy_bw, "copy_bytes": config.copy_mib << 20,
                   "matmul_flops_per_s": matmul, "matmul_n": config.matmul_size,
                   "matmul_dtype": config.dtype},
        "formulas": {"decode": rl.DECODE_BYTES_FORMULA, "prefill": rl.PREFILL_FLOPS_FORMULA},
        "memory": {"bytes_for_decode_pages": budget, "headroom_bytes": int(config.headroom_gib * rl.GIB)},
        "decode": decode,
        "prefill": prefill,
        "profile": profile,
        "seconds": time.perf_counter() - clock.start,
    }
