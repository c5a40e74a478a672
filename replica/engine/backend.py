"""What the engine needs from the thing that computes (pure Python: no torch).

`Engine`, the layer-level prefill (`replica/zigzag`), the migrating prefill (`replica/migration`) and
the weight calls drive a `Runner`; two implement it:

```
 Engine ── Runner ──┬── ModelRunner (runner.py, torch): the model's forward over the paged cache,
                    │   sampling from its logits
                    └── SimRunner (sim/runner.py, no torch): a named GPU's modelled step time,
                        deterministic tokens, KV pages and activations as scaled bytes
```

A forward may run whole (`forward`) or in parts (`context`, `embed`, `run_layers`, `logits`): the
hidden state and the context are the runner's own objects, handed back to it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from replica.engine.types import Choice, RowInput
from replica.model.config import ModelConfig


class SeqInput(NamedTuple):  # built per request per step: a NamedTuple is cheaper than a dataclass
    """One sequence of a forward: feed `tokens`, whose positions start at `start`, into `pages`."""

    tokens: Sequence[int]
    pages: Sequence[int]
    start: int
    all_logits: bool = False  # also return the logits of every fed token (prompt log-probabilities)


class KvCache(Protocol):
    """The paged KV cache as the engine and the transfer wiring see it."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def tensor(self) -> Any:
        """The buffer registered on the fabric (layer-major pages)."""
        ...

    @property
    def dtype(self) -> Any:
        """Element type (its `str` names it, e.g. `torch.bfloat16` or `bfloat16`)."""
        ...

    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer in `tensor` (K and V)."""
        ...


class Runner(Protocol):
    """One forward over the paged cache, whole or layer by layer, and the choice of next tokens."""

    cache: Any  # a KvCache

    @property
    def num_layers(self) -> int:
        """Transformer layers of the model."""
        ...

    @property
    def config(self) -> ModelConfig:
        """The model's hyper-parameters."""
        ...

    def inference(self) -> AbstractContextManager[object]:
        """Wraps every forward (torch: inference mode)."""
        ...

    def context(self, seqs: Sequence[SeqInput]) -> Any:
        """What every layer of one forward reuses (positions, page tables, masks; or its modelled time)."""
        ...

    def embed(self, seqs: Sequence[SeqInput]) -> Any:
        """The hidden state of every fed token after the embedding."""
        ...

    def run_layers(self, hidden: Any, ctx: Any, start: int, stop: int) -> Any:
        """Layers [start, stop) on `hidden`; each writes its K/V of the new tokens into the pages."""
        ...

    def logits(self, hidden: Any, ctx: Any, seqs: Sequence[SeqInput]) -> Any:
        """The head: a forward's output, read by `choose` and `prompt_logprobs`."""
        ...

    def forward(self, seqs: Sequence[SeqInput]) -> Any:
        """Embed, every layer, head."""
        ...

    def choose(self, out: Any, rows: Sequence[RowInput]) -> list[Choice]:
        """One next token per sequence of the forward."""
        ...

    def prompt_logprobs(self, out: Any, index: int, prompt: Sequence[int]) -> list[float]:
        """Log-probability of each prompt token of sequence `index` (NaN for the first)."""
        ...

    def empty_activation(self, tokens: int) -> Any:
        """A buffer for the hidden state of `tokens` tokens, to receive a relayed activation into."""
        ...

    def sendable(self, hidden: Any) -> Any:
        """A copy of `hidden` the fabric can register and send."""
        ...

    def resized(self, fraction: float) -> Runner | None:
        """A runner over a cache holding `fraction` of the memory left now (None: keep this one)."""
        ...

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes replayed from captured CUDA graphs (none: every step eager)."""
        ...

    def capture_graphs(self, max_batch: int) -> int:
        """Capture decode steps of up to `max_batch` rows as CUDA graphs; how many (0: none here)."""
        ...
