"""`SimRunner`: the engine's runner for a simulated GPU (`backend.Runner`, no torch).

```
 forward(seqs) ─► cost.step(fed tokens, cached tokens per sequence) ─► clock.settle(modelled seconds)
                  ─► SimOutput ─► choose: deterministic tokens (tokens.py)
 layer by layer: context (the step's cost) · embed · run_layers (k layers' share) · logits (head)
```
The KV cache is a real buffer of the card's page size times `--byte-scale` (`SimKvCache`), so
pages move over the fabric as they would, scaled; an activation is a buffer of the card's hidden
size times the scale. Nothing is computed: the hidden state only says how many tokens it holds.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from replica.engine.backend import SeqInput
from replica.engine.sim.clock import StepClock
from replica.engine.sim.cost import CostModel, Fed, StepCost
from replica.engine.sim.tokens import TokenPicker
from replica.engine.types import Choice, RowInput
from replica.model.config import ModelConfig

FIXED_PROMPT_LOGPROB = -1.0
"""Every prompt token's log-probability in a simulated prefill (the first one's is NaN)."""


def scaled(nbytes: int, scale: float) -> int:
    """`nbytes` times the byte scale, at least one byte."""
    return max(1, round(nbytes * scale))


class SimKvCache:
    """Layer-major KV pages as bytes: page p of layer l at `(l * num_blocks + p) * page_bytes`."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str, itemsize: int,
                 scale: float) -> None:
        self.num_layers, self.num_blocks, self.block_size = config.num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.full_page_bytes = 2 * block_size * config.kv_size * itemsize  # K and V of one layer
        self.page_bytes = scaled(self.full_page_bytes, scale)
        self._dtype = dtype
        # anonymous memory: pages count against the process's memory only once written (received)
        self._buffer = mmap.mmap(-1, self.num_layers * num_blocks * self.page_bytes)

    @property
    def tensor(self) -> mmap.mmap:
        """The buffer registered on the fabric."""
        return self._buffer

    @property
    def dtype(self) -> str:
        """The card's dtype name."""
        return self._dtype

    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer in the (scaled) buffer."""
        return self.page_bytes


@dataclass(frozen=True)
class SimHidden:
    """The hidden state of a simulated forward: how many tokens it holds."""

    tokens: int


@dataclass(frozen=True)
class SimContext:
    """One forward's modelled cost, reused by its parts."""

    cost: StepCost


@dataclass(frozen=True)
class SimOutput:
    """A simulated forward's output: what `choose` needs (nothing was computed)."""

    num_seqs: int


class SimRunner:
    """A `backend.Runner` whose forward takes the cost model's time (see module docstring)."""

    def __init__(self, config: ModelConfig, cache: SimKvCache, cost: CostModel, clock: StepClock,
                 picker: TokenPicker, itemsize: int, scale: float) -> None:
        self._config = config
        self.cache = cache
        self.cost = cost
        self.clock = clock
        self.picker = picker
        self.activation_bytes_per_token = scaled(config.hidden_size * itemsize, scale)

    @property
    def num_layers(self) -> int:
        """Transformer layers of the card."""
        return self._config.num_layers

    @property
    def config(self) -> ModelConfig:
        """The card."""
        return self._config

    def inference(self) -> AbstractContextManager[object]:
        """Nothing to switch on."""
        return contextlib.nullcontext()

    def step_cost(self, seqs: Sequence[SeqInput]) -> StepCost:
        """The modelled cost of a forward over `seqs`."""
        return self.cost.step([Fed(len(s.tokens), s.start) for s in seqs])

    def context(self, seqs: Sequence[SeqInput]) -> SimContext:
        """The forward's cost, computed once."""
        return SimContext(self.step_cost(seqs))

    def embed(self, seqs: Sequence[SeqInput]) -> SimHidden:
        """The embedding's share of the forward."""
        mark = self.clock.mark()
        self.clock.settle(mark, self.step_cost(seqs).embed)
        return SimHidden(sum(len(s.tokens) for s in seqs))

    def run_layers(self, hidden: Any, ctx: SimContext, start: int, stop: int) -> Any:
        """Layers [start, stop): their share of the forward."""
        mark = self.clock.mark()
        self.clock.settle(mark, ctx.cost.layers(stop - start))
        return hidden

    def logits(self, hidden: Any, ctx: SimContext, seqs: Sequence[SeqInput]) -> SimOutput:
        """The head's share of the forward."""
        mark = self.clock.mark()
        self.clock.settle(mark, ctx.cost.head)
        return SimOutput(len(seqs))

    def forward(self, seqs: Sequence[SeqInput]) -> SimOutput:
        """The whole forward's modelled time, from its start."""
        mark = self.clock.mark()
        self.clock.settle(mark, self.step_cost(seqs).total)
        return SimOutput(len(seqs))

    def choose(self, out: SimOutput, rows: Sequence[RowInput]) -> list[Choice]:
        """Deterministic tokens (`tokens.py`)."""
        return self.picker.choose(rows)

    def prompt_logprobs(self, out: SimOutput, index: int, prompt: Sequence[int]) -> list[float]:
        """NaN, then a fixed log-probability per prompt token."""
        return [math.nan, *([FIXED_PROMPT_LOGPROB] * (len(prompt) - 1))]

    def empty_activation(self, tokens: int) -> bytearray:
        """The activation of `tokens` tokens, scaled."""
        return bytearray(tokens * self.activation_bytes_per_token)

    def sendable(self, hidden: Any) -> bytearray:
        """The activation's bytes (a received one is sent as it is)."""
        if isinstance(hidden, SimHidden):
            return self.empty_activation(hidden.tokens)
        return bytearray(hidden)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """None: a simulated GPU captures no graphs."""
        return ()

    def capture_graphs(self, max_batch: int) -> int:
        """A simulated GPU has no graphs to capture: its step times are modelled."""
        return 0

    def resized(self, fraction: float) -> None:
        """The cache is what the GPU's memory leaves after the weights: Warmup does not resize it."""
        return None
