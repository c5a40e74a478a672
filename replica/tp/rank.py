"""One rank's model and KV cache: its shard of the weights read from the checkpoint, its KV heads.

Every rank of a group builds the same pages (`num_blocks` x `block_size`, chosen by the leader), so
the leader's page table addresses every rank's cache; each rank's pages hold only its KV heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.layout import Shard, WeightLayout
from replica.model.weights import allocate_buffer, load_weights
from replica.tp.group import TpGroup
from replica.tp.sharded import TpCausalLM, build_rank_model, rank_config, rank_layout


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group is built from (the leader passes it to the workers it starts)."""

    model_dir: Path
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    attention_backend: str = "torch"
    inactive: bool = False  # start without weights (zeros): they come by LoadParams or a multicast


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th CUDA device counted from the leader's, or the CPU."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def share_cpu_threads(world: int) -> None:
    """On the CPU the ranks split the cores (one process per CPU slice), instead of each taking all."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))  # the cores this process may use


@dataclass(frozen=True)
class RankModel:
    """This rank's share of the weights (layout, flat buffer), the model over it and its pages."""

    layout: WeightLayout
    buffer: torch.Tensor
    model: TpCausalLM
    cache: PagedKVCache


def build_rank(spec: RankSpec, group: TpGroup, device: torch.device) -> RankModel:
    """Load this rank's shard onto `device` (none when `spec.inactive`) and allocate its own pages."""
    config = ModelConfig.from_dir(spec.model_dir)
    shard: Shard = group.shard
    layout = rank_layout(config, spec.dtype, shard)
    buffer = allocate_buffer(layout, str(device))
    model = build_rank_model(config, buffer, spec.dtype, shard)
    if spec.inactive:
        buffer.zero_()
    else:
        load_weights(spec.model_dir, layout, buffer)
    cache = PagedKVCache.for_model(rank_config(config, shard), spec.num_blocks, spec.block_size, spec.dtype,
                                   str(device))
    return RankModel(layout, buffer, model, cache)
