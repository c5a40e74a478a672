"""Sizing the KV cache of the torch engine from the memory a device has left."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can still get on `device` (CPU: MemAvailable of /proc/meminfo)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def blocks_for_memory(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
    """Pages that fit in `budget_bytes` (at least one)."""
    per_block = PagedKVCache.bytes_per_block(config, block_size, dtype)
    return max(int(budget_bytes // per_block), 1)


def resized_cache(cache: PagedKVCache, config: ModelConfig, fraction: float) -> PagedKVCache | None:
    """A cache holding `fraction` of the memory left, the old cache's own bytes counted as left
    (None when the page count would not change). The old pages are dropped first."""
    tensor = cache.tensor
    if tensor.device.type == "cuda":
        return None  # sized at start from the profile run and --gpu-memory-fraction (factory.py)
    left = available_memory_bytes(tensor.device) + tensor.numel() * tensor.element_size()
    num_blocks = blocks_for_memory(config, cache.block_size, cache.dtype, left * fraction)
    if num_blocks == cache.num_blocks:
        return None
    device = str(tensor.device)
    cache.tensor = torch.empty(0, dtype=cache.dtype)  # drop the old pages before the new ones are made
    return PagedKVCache.for_model(config, num_blocks, cache.block_size, cache.dtype, device)


# Memory the CUDA context and the allocator's slack take beside torch's own allocations: not seen by
# `torch.cuda.memory_allocated`, so the share of `--gpu-memory-fraction` left for pages is reduced by it.
CUDA_CONTEXT_BYTES = 768 << 20


def cuda_kv_budget(device: torch.device, fraction: float, activation_bytes: int) -> int:
    """Bytes the KV pages may take on a CUDA device after the weights and a profile run.

    The replica may take `fraction` of the device in all: weights (already allocated), the profile
    run's activation peak (`activation_bytes`, it recurs at every big prefill), the CUDA context, and
    the pages. What the device has free now bounds it too, so replicas sharing one GPU each keep to
    what the others left.
    """
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    own_share = total * fraction - held - activation_bytes - CUDA_CONTEXT_BYTES
    # the allocator's cached but unused blocks are free for this process too
    free_now = free + torch.cuda.memory_reserved(device) - held - activation_bytes
    return max(int(min(own_share, free_now)), 0)
