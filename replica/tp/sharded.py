"""Megatron sharding applied from outside the plain model: `TpCausalLM` over one rank's shard.

```
 ids ─► vocab-parallel embed (own rows, others 0) ─all-reduce─► hidden (n, H), same on every rank
 each layer: q/k/v heads of this rank (KV heads shared when fewer than ranks) ─► o_proj rows ─all-reduce─►
             gate/up columns of this rank ─► down rows ─all-reduce─►
 head: norm ─► lm_head rows of this rank (m, V/tp) ─all-gather─► (m, V) float32 logits
```

The model math (`replica.model.llama.CausalLM`) is unchanged: it is built over this rank's slice of
the flat buffer with a per-rank `ModelConfig` (heads, KV heads, MLP width divided), and the two
row-parallel projections of each layer are swapped for `RowParallel`, which adds the all-reduce.
Every rank computes the same hidden states, so the caller sees one model of the full config.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replica.model.attention import ForwardContext
from replica.model.config import ModelConfig
from replica.model.layout import Shard, WeightLayout
from replica.model.llama import CausalLM, DecoderLayer, Projection, build_model
from replica.model.weights import dtype_name


def rank_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The dims one rank's modules see: heads, KV heads (at least one), MLP width and vocab divided."""
    world = shard.world
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=max(config.num_kv_heads // world, 1),
        intermediate_size=config.intermediate_size // world,
        vocab_size=config.vocab_size // world,
    )


def rank_layout(config: ModelConfig, dtype: torch.dtype, shard: Shard) -> WeightLayout:
    """This rank's share of the flat weight buffer (the full config's tensors, cut for `shard`)."""
    return WeightLayout.for_config(config, dtype_name(dtype), shard)


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial sum, then the all-reduce over the group.

    A replicated bias is added by rank 0 only, so the sum holds it once.
    """

    def __init__(self, projection: Projection, shard: Shard, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = projection.weights[0]
        self.bias = projection.biases[0] if len(projection.biases) and shard.rank == 0 else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight, self.bias)
        dist.all_reduce(partial, group=self.group)
        return partial


class TpCausalLM(nn.Module):
    """One rank of a tensor-parallel group: the `CausalLM` interface over the full config."""

    def __init__(self, config: ModelConfig, local: CausalLM, shard: Shard,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.local, self.shard, self.group = config, local, shard, group
        self.vocab_start = shard.rank * local.config.vocab_size  # first token id of this rank's rows
        for layer in local.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attn.o_proj = RowParallel(layer.attn.o_proj, shard, group)  # type: ignore[assignment]
            layer.mlp.down = RowParallel(layer.mlp.down, shard, group)  # type: ignore[assignment]

    @property
    def layers(self) -> nn.ModuleList:
        """The rank's decoder layers (their attention writes this rank's KV heads)."""
        return self.local.layers

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(n,) ids -> (n, hidden): each rank looks up the ids in its vocabulary rows, zero elsewhere."""
        local_ids = token_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.local.config.vocab_size)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.local.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(hidden, group=self.group)
        return hidden

    @torch.no_grad()
    def layer_forward(self, index: int, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Decoder layer `index` (two all-reduces inside)."""
        return self.local.layer_forward(index, hidden, ctx)

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(m, hidden) -> (m, vocab) float32 logits: every rank's vocabulary slice, gathered."""
        part = self.local.head(hidden).contiguous()  # (m, vocab / world)
        parts = [torch.empty_like(part) for _ in range(self.shard.world)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Embed and every layer: (n,) ids -> (n, hidden) final hidden states (before the norm)."""
        hidden = self.embed(token_ids)
        for index in range(self.config.num_layers):
            hidden = self.local.layer_forward(index, hidden, ctx)
        return hidden


def build_rank_model(config: ModelConfig, buffer: torch.Tensor, dtype: torch.dtype, shard: Shard,
                     group: dist.ProcessGroup | None = None) -> TpCausalLM:
    """This rank's model over `buffer`, which holds (or will hold) `rank_layout(config, dtype, shard)`."""
    layout = rank_layout(config, dtype, shard)
    local = build_model(rank_config(config, shard), layout, buffer, dtype)
    return TpCausalLM(config, local, shard, group)
