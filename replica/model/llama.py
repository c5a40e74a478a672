"""Llama / Mistral / Qwen2 as one plain `nn.Module` family whose parameters are views into the flat buffer.

```
 token_ids (n,) ─ embed ─► hidden (n, H) ─► layer 0 … layer L-1 ─► head: final norm, lm_head ─► logits
 each layer:  h += o_proj(attend(rope(q), rope(k), v))   on input_layernorm(h)
              h += down(silu(gate(x)) * up(x))            on post_attention_layernorm(h)
```

The batch is one flat ragged token array (all sequences concatenated, no padding); the
`AttentionContext` knows which token belongs to which sequence and where its KV pages are. The
module does no I/O: `load_model` (disk) and `build_model` (a buffer that arrived over the network)
create it over an existing buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from replica.model.attention import ForwardContext
from replica.model.config import ModelConfig, UnsupportedModel
from replica.model.layout import EMBED_NAME, LM_HEAD_NAME, NORM_NAME, WeightLayout
from replica.model.linear import linear
from replica.model.rope import rotate
from replica.model.weights import (
    RegionCallback,
    allocate_buffer,
    dtype_name,
    load_weights,
    tensor_views,
)

Views = dict[str, torch.Tensor]


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A parameter sharing `tensor`'s memory (a view into the flat buffer), never trained."""
    return nn.Parameter(tensor, requires_grad=False)


def _fused(views: Views, names: list[str]) -> torch.Tensor | None:
    """One view covering `names` concatenated along dim 0, if they sit back to back in memory."""
    parts = [views[n] for n in names]
    first = parts[0]
    for before, after in itertools.pairwise(parts):
        if after.data_ptr() != before.data_ptr() + before.numel() * before.element_size():
            return None
    rows = sum(p.shape[0] for p in parts)
    storage_offset = first.storage_offset()
    return first.as_strided((rows, *first.shape[1:]), first.stride(), storage_offset)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the model dtype (as transformers does)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _frozen(weight)
        self.eps = eps
        self._weight = self.weight.detach()  # same memory; a plain attribute reads faster per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # F.rms_norm's own float32 steps (mean of squares, + eps, rsqrt, x * that, * weight), two of
            # them in place and x * x for pow(x, 2) (which computes just that): the same bits (tested),
            # without F.rms_norm's per-call overhead on the CPU
            scale = (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return (x * scale).mul_(self._weight)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Projection(nn.Module):
    """Linear maps `x @ weight.T + bias` over views of one or more HF matrices.

    Several matrices (q/k/v, gate/up) run as one matmul when they sit back to back in the buffer
    (the layout places them so); otherwise each runs alone. Never copies: weights may still be
    arriving over the network when the module is built.
    """

    def __init__(self, views: Views, names: list[str], biases: list[str] | None) -> None:
        super().__init__()
        self.sizes = [views[n].shape[0] for n in names]
        weight = _fused(views, names)
        bias = _fused(views, biases) if biases else None
        self.fused = weight is not None and (bias is not None or not biases)
        if self.fused:
            self.weights = nn.ParameterList([_frozen(weight)])  # type: ignore[arg-type]
            self.biases = nn.ParameterList([_frozen(bias)] if bias is not None else [])
        else:
            self.weights = nn.ParameterList(_frozen(views[n]) for n in names)
            self.biases = nn.ParameterList(_frozen(views[n]) for n in biases or [])
        # plain references for the hot path (ParameterList indexing costs a Python call each time)
        self._pairs = [(w, self.biases[i] if len(self.biases) else None) for i, w in enumerate(self.weights)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output of the first (or fused) matrix."""
        weight, bias = self._pairs[0]
        return linear(x, weight, bias)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One output per HF matrix, in order."""
        if self.fused:
            return self(x).split_with_sizes(self.sizes, dim=-1)
        return tuple(linear(x, w, b) for w, b in self._pairs)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, reading and writing the paged cache through the context."""

    def __init__(self, config: ModelConfig, views: Views, prefix: str, layer: int) -> None:
        super().__init__()
        p = prefix + "self_attn."
        qkv_bias = [p + f"{n}_proj.bias" for n in "qkv"] if config.qkv_bias else None
        self.qkv = Projection(views, [p + f"{n}_proj.weight" for n in "qkv"], qkv_bias)
        self.o_proj = Projection(views, [p + "o_proj.weight"], [p + "o_proj.bias"] if config.o_bias else None)
        self.layer, self.heads, self.kv_heads = layer, config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, heads, kv_heads, head_dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.qkv.fused:
            qkv = self.qkv(x)  # (n, (heads + 2 * kv_heads) * head_dim)
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :]
        else:
            q, k, v = self.qkv.parts(x)
            qk = torch.cat((q, k), dim=-1).view(n, heads + kv_heads, head_dim)
        qk = rotate(qk, ctx.cos, ctx.sin_signed)  # q and k heads rotated together: one set of ops
        out = ctx.attend(self.layer, qk[:, :heads], qk[:, heads:], v.view(n, kv_heads, head_dim))
        return self.o_proj(out)  # out: (n, heads * head_dim)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, views: Views, prefix: str) -> None:
        super().__init__()
        p = prefix + "mlp."
        biases = [p + "gate_proj.bias", p + "up_proj.bias"] if config.mlp_bias else None
        self.gate_up = Projection(views, [p + "gate_proj.weight", p + "up_proj.weight"], biases)
        self.down = Projection(
            views, [p + "down_proj.weight"], [p + "down_proj.bias"] if config.mlp_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.parts(x)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelConfig, views: Views, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_norm = RMSNorm(views[prefix + "input_layernorm.weight"], config.rms_norm_eps)
        self.attn = Attention(config, views, prefix, index)
        self.post_norm = RMSNorm(views[prefix + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.mlp = MLP(config, views, prefix)
        # plain references for the hot path (a submodule attribute is looked up through a Python call)
        self._blocks = (self.input_norm, self.attn, self.post_norm, self.mlp)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        input_norm, attn, post_norm, mlp = self._blocks
        hidden = hidden + attn(input_norm(hidden), ctx)
        return hidden + mlp(post_norm(hidden))


class CausalLM(nn.Module):
    """The decoder-only language model over one flat weight buffer."""

    def __init__(self, config: ModelConfig, views: Views) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _frozen(views[EMBED_NAME])
        self.layers = nn.ModuleList(DecoderLayer(config, views, i) for i in range(config.num_layers))
        self.norm = RMSNorm(views[NORM_NAME], config.rms_norm_eps)
        # With tied embeddings this is the same memory as embed_tokens (the layout has no lm_head tensor).
        self.lm_head = _frozen(views[LM_HEAD_NAME])

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 token ids -> (n, hidden) embeddings."""
        return F.embedding(token_ids, self.embed_tokens)

    @torch.no_grad()
    def layer_forward(self, index: int, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Run decoder layer `index` on (n, hidden); writes this layer's new KV into the cache."""
        layer: DecoderLayer = self.layers[index]  # type: ignore[assignment]
        return layer(hidden, ctx)

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(m, hidden) -> (m, vocab) float32 logits, final norm applied."""
        return linear(self.norm(hidden), self.lm_head).float()

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Embed and run every layer: (n,) token ids -> (n, hidden) final hidden states (before the norm)."""
        hidden = F.embedding(token_ids, self.embed_tokens)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return hidden


# architectures entry -> model class. One family today; a new architecture registers here.
MODEL_CLASSES: dict[str, Callable[[ModelConfig, Views], CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
}


@dataclass
class LoadedModel:
    """A model with the buffer and layout its parameters live in."""

    config: ModelConfig
    layout: WeightLayout
    buffer: torch.Tensor
    model: CausalLM


def build_model(
    config: ModelConfig, layout: WeightLayout, buffer: torch.Tensor, dtype: torch.dtype
) -> CausalLM:
    """A model whose parameters are views over `buffer` (filled already, or to be filled by transfers)."""
    if layout.dtype != dtype_name(dtype):
        raise ValueError(f"layout dtype {layout.dtype} differs from {dtype}")
    if config.architecture not in MODEL_CLASSES:
        raise UnsupportedModel(f"no model class for architecture {config.architecture!r}")
    return MODEL_CLASSES[config.architecture](config, tensor_views(layout, buffer)).eval()


def load_model(
    path: Path, dtype: torch.dtype, device: str = "cpu", on_region: RegionCallback | None = None
) -> LoadedModel:
    """Read the checkpoint folder at `path` into a new flat buffer and build the model over it."""
    config = ModelConfig.from_dir(Path(path))
    layout = WeightLayout.for_config(config, dtype_name(dtype))
    buffer = allocate_buffer(layout, device)
    model = build_model(config, layout, buffer, dtype)
    load_weights(Path(path), layout, buffer, on_region)
    return LoadedModel(config, layout, buffer, model)
