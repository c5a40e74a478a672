"""Building an `Engine` from a `ReplicaConfig`: load the checkpoint, size the cache, derive the limits.

```
 --device/--dtype ─► device.choose ─► load the weights onto the device (pinned staging on CUDA)
   CPU:  pages = --num-blocks, or --kv-memory-fraction of the memory available (resized at Warmup)
   CUDA: pages = --num-blocks, or what --gpu-memory-fraction leaves after the weights and a profile
         run of the largest prefill (torch.cuda.mem_get_info; kept at Warmup, which captures graphs)
```
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from replica.config import ReplicaConfig
from replica.engine import packing
from replica.engine.detokenizer import Detokenizer
from replica.engine.device import TORCH_DTYPES, DeviceChoice, choose
from replica.engine.engine import Engine, EngineMeta
from replica.engine.memory import available_memory_bytes, blocks_for_memory, cuda_kv_budget
from replica.engine.runner import ModelRunner
from replica.engine.switch import ModelSwitch
from replica.engine.validation import Limits, derive_limits
from replica.engine.warmup import MAX_GRAPH_BATCH, profile_inputs, profile_lengths
from replica.model import compiled_attention, linear, native_attention
from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.model.llama import CausalLM, LoadedModel, build_model, load_model
from replica.model.weights import dtype_name
from replica.params.readiness import ParamReadiness
from replica.params.store import ParamStore

log = logging.getLogger(__name__)

__all__ = ["TORCH_DTYPES", "build_engine", "build_engine_and_params"]


def build_engine(config: ReplicaConfig, device: str | None = None) -> Engine:
    """Load the model and make an engine with a KV cache of `--num-blocks` or sized from memory."""
    return build_engine_and_params(config, device)[0]


def build_engine_and_params(config: ReplicaConfig, device: str | None = None) -> tuple[Engine, ParamStore]:
    """The engine and its parameter store; with `--inactive` the weight buffer is allocated, not loaded.

    `device` overrides `config.device` (tests). The model's parameters are views into the store's
    flat buffer in both cases, so weights that arrive later (LoadParams, transfers) are the model
    without any copy.
    """
    if device is not None:
        config = replace(config, device=device)
    if config.model is None:
        raise ValueError("the torch engine needs --model (a checkpoint folder)")
    model_dir = config.model
    choice = choose(config)
    dtype, where = choice.torch_dtype, choice.device
    model_config = ModelConfig.from_dir(model_dir)
    layout = WeightLayout.for_config(model_config, dtype_name(dtype))
    capacity = max(layout.total_bytes, config.weight_buffer_bytes,
                   *(WeightLayout.for_config(ModelConfig.from_dir(Path(d)), layout.dtype).total_bytes
                     for d in config.weight_buffer_models))
    if config.inactive:
        whole = torch.zeros(capacity, dtype=torch.uint8, device=where)
        buffer = whole[: layout.total_bytes]
        model = build_model(model_config, layout, buffer, dtype)
        log.info("inactive: weight buffer of %d bytes allocated, nothing loaded", capacity)
    else:
        loaded = load_model(model_dir, dtype, str(where))
        layout, buffer, model = loaded.layout, loaded.buffer, loaded.model
        whole, buffer, model = _with_room(loaded, capacity, dtype)
    readiness = ParamReadiness(model_config.num_layers, loaded=not config.inactive)
    linear.use_onednn(config.cpu_onednn)
    packs = None
    if config.cpu_onednn and config.cpu_packed_weights:
        packs = packing.track(model, readiness)  # before the KV pages are sized: the packs take memory too
    elif config.cpu_onednn:
        linear.warm(packing.linear_pairs(model))  # oneDNN's kernels for every row bucket, built now
    root = config.model_root or Path(model_dir).resolve().parent
    params = ParamStore(layout, buffer, readiness, root, config.disk_gbps, config.host_gbps,
                        host_cache_bytes=config.host_cache_bytes, model_name=Path(model_dir).name)
    if config.host_cache:
        params.warm_host_copy(Path(model_dir))
    params.warm_host_models(config.host_models)
    limits = derive_limits(config, model_config)
    num_blocks = _num_blocks(config, choice, model, limits)
    cache = PagedKVCache.for_model(model_config, num_blocks, config.block_size, dtype, str(where))
    choice = _kernels_built(choice, cache, model_config)
    log.info("KV cache: %d pages of %d tokens on %s (%s, attention: %s)", num_blocks, config.block_size,
             where, choice.dtype.value, choice.attention_backend)
    meta = _meta(config, choice)
    detok = Detokenizer.from_model_dir(model_dir)
    runner = ModelRunner(model, cache, choice.attention_backend)
    if meta.cuda_graphs:
        # Graphs hold the weights' and pages' addresses, not their values: an inactive replica's
        # graphs serve the weights that arrive later. Warmup captures again after a cache change.
        count = runner.capture_graphs(min(MAX_GRAPH_BATCH, num_blocks))
        log.info("decode CUDA graphs: %d batch sizes %s", count, runner.graph_buckets)
    engine = Engine(runner, detok, limits, meta, readiness)
    params.room = whole
    if config.tp == 1:
        params.relayout = ModelSwitch(engine, params, whole, config, dtype, packs)  # another model's shape
    return engine, params


def _with_room(loaded: LoadedModel, capacity: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, CausalLM]:
    """(whole buffer, the model's prefix of it, the model over it): the loaded buffer itself when it
    is all the room asked for, else copied into the prefix of a larger one (--weight-buffer-bytes)."""
    if capacity == loaded.layout.total_bytes:
        return loaded.buffer, loaded.buffer, loaded.model
    whole = torch.zeros(capacity, dtype=torch.uint8, device=loaded.buffer.device)
    buffer = whole[: loaded.layout.total_bytes]
    buffer.copy_(loaded.buffer)
    return whole, buffer, build_model(loaded.config, loaded.layout, buffer, dtype)


def _kernels_built(choice: DeviceChoice, cache: PagedKVCache, model_config: ModelConfig) -> DeviceChoice:
    """Build the CPU decode kernel of the `compiled` / `native` backends now, not at the first decode
    step; a native kernel that cannot be built leaves the replica on the torch path (logged)."""
    group = model_config.num_heads // model_config.num_kv_heads
    if choice.attention_backend == "compiled":
        log.info("compiled decode attention built in %.1f s", compiled_attention.warm(cache, group))
    elif choice.attention_backend == "native":
        try:
            log.info("native decode attention built in %.2f s", native_attention.warm(cache, group))
        except native_attention.NativeBuildError as e:
            log.warning("attention falls back to the torch path: the native kernel: %s", e)
            return replace(choice, attention_backend="torch")
    return choice


def _meta(config: ReplicaConfig, choice: DeviceChoice) -> EngineMeta:
    return EngineMeta(
        model_id=config.name,
        dtype=choice.dtype.value,
        device_type=choice.device.type,
        device=str(choice.device),
        gpu_name=choice.gpu_name,
        attention_backend=choice.attention_backend,
        cuda_graphs=choice.is_cuda and config.cuda_graphs and choice.attention_backend == "triton",
        prefix_cache=config.prefix_cache,
    )


def _num_blocks(config: ReplicaConfig, choice: DeviceChoice, model: CausalLM, limits: Limits) -> int:
    """`--num-blocks`, or pages sized from the memory this device has for them."""
    if config.num_blocks is not None:
        return config.num_blocks
    model_config, dtype = model.config, choice.torch_dtype
    if not choice.is_cuda:
        budget = available_memory_bytes(choice.device) * config.kv_memory_fraction
        return blocks_for_memory(model_config, config.block_size, dtype, budget)
    activations = _profile_activation_bytes(config, choice, model, limits)
    budget = cuda_kv_budget(choice.device, config.gpu_memory_fraction, activations)
    blocks = blocks_for_memory(model_config, config.block_size, dtype, budget)
    log.info("CUDA memory: profile run's activations %.2f GiB, %.2f GiB for KV pages (%d pages) within "
             "--gpu-memory-fraction %.2f", activations / 2**30, budget / 2**30, blocks,
             config.gpu_memory_fraction)
    if budget <= 0:
        raise ValueError(f"--gpu-memory-fraction {config.gpu_memory_fraction} leaves no memory for KV "
                         f"pages on {choice.device} after the weights and the profile run")
    return blocks


def _profile_activation_bytes(config: ReplicaConfig, choice: DeviceChoice, model: CausalLM,
                              limits: Limits) -> int:
    """The activation peak of the largest prefill the limits allow, over a cache of just its pages."""
    if config.inactive:
        return _estimate_activation_bytes(model.config, limits.max_prefill_tokens)
    lengths = profile_lengths(limits.max_prefill_tokens, limits.max_input_tokens)
    bs = config.block_size
    pages = [-(-n // bs) for n in lengths]
    cache = PagedKVCache.for_model(model.config, sum(pages), bs, choice.torch_dtype, str(choice.device))
    runner = ModelRunner(model, cache, choice.attention_backend)
    torch.cuda.synchronize(choice.device)
    torch.cuda.reset_peak_memory_stats(choice.device)
    before = torch.cuda.memory_allocated(choice.device)
    offsets = [sum(pages[:i]) for i in range(len(pages))]
    page_lists = [list(range(o, o + n)) for o, n in zip(offsets, pages, strict=True)]
    runner.forward(profile_inputs(lengths, page_lists, limits.vocab_size))
    torch.cuda.synchronize(choice.device)
    peak = torch.cuda.max_memory_allocated(choice.device) - before
    del runner, cache
    torch.cuda.empty_cache()
    return int(peak)


def _estimate_activation_bytes(config: ModelConfig, tokens: int) -> int:
    """Without weights (an inactive replica) no profile can run: a bound from the shapes instead
    (the MLP's gate and up projections in float32, plus the float32 logits of one row per token)."""
    per_token = 4 * 3 * config.intermediate_size + 4 * 4 * config.hidden_size + 4 * config.vocab_size
    return tokens * per_token
