"""Building an `Engine` from a `ReplicaConfig`: load the checkpoint, size the cache, derive the limits."""

from __future__ import annotations

import logging

import torch

from replica.config import DType, ReplicaConfig
from replica.engine.detokenizer import Detokenizer
from replica.engine.engine import Engine, EngineMeta
from replica.engine.runner import ModelRunner
from replica.engine.validation import Limits
from replica.engine.warmup import available_memory_bytes, blocks_for_memory
from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.llama import load_model

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
    dtype = TORCH_DTYPES[config.dtype]
    loaded = load_model(config.model, dtype, device)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        left = available_memory_bytes(torch.device(device))
        budget = left * config.kv_memory_fraction
        num_blocks = blocks_for_memory(loaded.config, config.block_size, dtype, budget)
    cache = PagedKVCache.for_model(loaded.config, num_blocks, config.block_size, dtype, device)
    log.info("KV cache: %d pages of %d tokens", num_blocks, config.block_size)
    meta = EngineMeta(model_id=config.name, dtype=config.dtype.value, device_type=torch.device(device).type)
    detok = Detokenizer.from_model_dir(config.model)
    return Engine(ModelRunner(loaded.model, cache), detok, derive_limits(config, loaded.config), meta)
