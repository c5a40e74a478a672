"""How long a forward takes on the simulated GPU: a roofline model of the card on the GPU (pure Python).

```
 one forward = embed + L × layer + head, each op  max(FLOPs / (peak × compute eff),
                                                      bytes / (bandwidth × memory eff))
 layer: dense GEMMs  2 · P_layer · T FLOPs  over  P_layer · itemsize weight bytes
        attention    4 · q_size · Σ_i (n_i·s_i + n_i(n_i+1)/2) FLOPs  over  the K/V of Σ_i (s_i + n_i) tokens
 head:  2 · hidden · vocab FLOPs per sequence (its last token)  over  vocab · hidden · itemsize bytes
```
`T` = tokens fed, sequence i feeds `n_i` tokens after `s_i` cached ones. A prefill of T tokens is
compute-bound (≈ 2·params·T FLOPs), a decode step memory-bound (every weight and the whole context's
K/V read once per step): the two regimes whose ratio the scaling policies care about.
`ProfileCost` (`profile.py`) answers the same question from measured tables instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from replica.engine.sim.gpus import GpuSpec
from replica.model.config import ModelConfig


class Fed(NamedTuple):
    """One sequence of a forward: `tokens` fed after `start` cached ones."""

    tokens: int
    start: int


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds of one forward, in the parts a layer-by-layer forward runs."""

    embed: float
    layer: float  # each transformer layer
    head: float
    num_layers: int

    @property
    def total(self) -> float:
        """The whole forward."""
        return self.embed + self.layer * self.num_layers + self.head

    def layers(self, count: int) -> float:
        """`count` transformer layers."""
        return self.layer * count


class CostModel(Protocol):
    """Seconds of a forward over the given sequences."""

    def step(self, seqs: Sequence[Fed]) -> StepCost:
        """The forward's cost."""
        ...


def layer_params(config: ModelConfig) -> int:
    """Parameters of one transformer layer (attention, MLP, norms, biases)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    params = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if config.qkv_bias:
        params += q + 2 * kv
    return params


def kv_bytes_per_token(config: ModelConfig, itemsize: int) -> int:
    """K and V of one token over all layers."""
    return 2 * config.num_layers * config.kv_size * itemsize


class Roofline:
    """The roofline cost of the card's forward on the GPU (see module docstring)."""

    def __init__(self, config: ModelConfig, itemsize: int, gpu: GpuSpec, compute_efficiency: float,
                 memory_efficiency: float) -> None:
        self.config = config
        self.itemsize = itemsize
        self.flops = gpu.flops * compute_efficiency
        self.bandwidth = gpu.mem_bytes_per_s * memory_efficiency
        self.layer_params = layer_params(config)
        self.kv_token_layer = 2 * config.kv_size * itemsize  # one token's K and V in one layer

    def _op(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.bandwidth)

    def step(self, seqs: Sequence[Fed]) -> StepCost:
        """The forward's cost, op by op."""
        c = self.config
        tokens = sum(s.tokens for s in seqs)
        pairs = sum(s.tokens * s.start + s.tokens * (s.tokens + 1) // 2 for s in seqs)  # (query, key) pairs
        context = sum(s.start + s.tokens for s in seqs)
        dense = self._op(2.0 * self.layer_params * tokens, self.layer_params * self.itemsize)
        attention = self._op(4.0 * c.q_size * pairs, self.kv_token_layer * context)
        head_bytes = c.vocab_size * c.hidden_size * self.itemsize
        head = self._op(2.0 * c.hidden_size * c.vocab_size * len(seqs), head_bytes)
        embed = tokens * c.hidden_size * self.itemsize / self.bandwidth
        return StepCost(embed, dense + attention, head, c.num_layers)
