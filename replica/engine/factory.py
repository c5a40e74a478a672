"""Building an `Engine` from a `ReplicaConfig`: load the checkpoint, size the cache, derive the limits."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replica.config import DType, ReplicaConfig
from replica.engine.detokenizer import Detokenizer
from replica.engine.engine import Engine, EngineMeta
from replica.engine.runner import ModelRunner
from replica.engine.validation import Limits
from replica.engine.warmup import available_memory_bytes, blocks_for_memory
from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.model.llama import build_model, load_model
from replica.model.weights import dtype_name
from replica.params.readiness import ParamReadiness
from replica.params.store import ParamStore

log = logging.getLogger(__name__)

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


def derive_limits(config: ReplicaConfig, model: ModelConfig) -> Limits:
    """Input/total/prefill limits: configured values, never past the model's positions."""
    positions = model.max_position_embeddings
    max_total = min(config.max_total_tokens or positions, positions)
    max_input = min(config.max_input_tokens or max_total - 1, max_total - 1)
    if max_input <= 0:
        raise ValueError(f"max_total_tokens {max_total} leaves no room for a prompt")
    if config.max_total_tokens and config.max_total_tokens > positions:
        log.warning("max_total_tokens %d capped at %d positions", config.max_total_tokens, positions)
    return Limits(
        vocab_size=model.vocab_size,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_prefill_tokens=max(config.max_batch_prefill_tokens, max_input),
    )


def build_engine(config: ReplicaConfig, device: str = "cpu") -> Engine:
    """Load the model and make an engine with a KV cache of `--num-blocks` or sized from memory."""
    return build_engine_and_params(config, device)[0]


def build_engine_and_params(config: ReplicaConfig, device: str = "cpu") -> tuple[Engine, ParamStore]:
    """The engine and its parameter store; with `--inactive` the weight buffer is allocated, not loaded.

    The model's parameters are views into the store's flat buffer in both cases, so weights that
    arrive later (LoadParams, transfers) are the model without any copy.
    """
    dtype = TORCH_DTYPES[config.dtype]
    model_config = ModelConfig.from_dir(config.model)
    layout = WeightLayout.for_config(model_config, dtype_name(dtype))
    if config.inactive:
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        model = build_model(model_config, layout, buffer, dtype)
        log.info("inactive: weight buffer of %d bytes allocated, nothing loaded", layout.total_bytes)
    else:
        loaded = load_model(config.model, dtype, device)
        layout, buffer, model = loaded.layout, loaded.buffer, loaded.model
    readiness = ParamReadiness(model_config.num_layers, loaded=not config.inactive)
    root = config.model_root or Path(config.model).resolve().parent
    params = ParamStore(layout, buffer, readiness, root, config.disk_gbps, config.host_gbps)
    if config.host_cache:
        params.warm_host_copy(Path(config.model))
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        left = available_memory_bytes(torch.device(device))
        budget = left * config.kv_memory_fraction
        num_blocks = blocks_for_memory(model_config, config.block_size, dtype, budget)
    cache = PagedKVCache.for_model(model_config, num_blocks, config.block_size, dtype, device)
    log.info("KV cache: %d pages of %d tokens", num_blocks, config.block_size)
    meta = EngineMeta(model_id=config.name, dtype=config.dtype.value, device_type=torch.device(device).type)
    detok = Detokenizer.from_model_dir(config.model)
    limits = derive_limits(config, model_config)
    return Engine(ModelRunner(model, cache), detok, limits, meta, readiness), params
