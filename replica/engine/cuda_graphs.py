"""Decode steps replayed from CUDA graphs, one graph per bucketed batch size.

```
 capture (Warmup, no batch cached):  for each bucket b, largest first, sharing one memory pool:
     fill the static context with a dummy one-token row (padded to b) ─► eager step (compiles
     the kernels) ─► capture: logits[b] = head(model(tokens[:b], static ctx))
 step (all rows one-token decodes, n ≤ the largest bucket):
     tokens and context of the n rows ─► static buffers (rows n..b-1 repeat row 0) ─► replay b
     ─► logits[:n]
```

A decode step on a GPU is dominated by kernel launches at small batches (a few hundred per step);
a graph replays them in one launch. Rows past `n` repeat row 0 exactly (same token, position,
pages and slot), so they write the very bytes row 0 writes into the same slot: padding changes no
page. Prefill, mixed batches and layer-by-layer forwards stay eager.

Without CUDA (`capture=False`) the same static path runs eagerly, so its padding and buffers are
tested on the CPU against the ordinary forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from replica.engine.backend import SeqInput
from replica.model.attention import PagedKVCache, SeqSlice, StaticDecodeContext
from replica.model.llama import CausalLM

log = logging.getLogger(__name__)

# Batch sizes with a graph of their own: a step pads to the next one up (at most ~1/3 wasted rows).
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets up to `max_batch`, ending with `max_batch` itself."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    return (*(b for b in BUCKETS if b < max_batch), max_batch)


class DecodeGraphs:
    """Static buffers for one-token decode steps and, once captured, a CUDA graph per bucket."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_batch: int, max_pages: int) -> None:
        device = cache.tensor.device
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.ctx = StaticDecodeContext(cache, model.config, max_batch, max_pages)
        self.max_pages = max_pages
        self.block_size = cache.block_size
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # (max_batch,)
        self._host_tokens = torch.zeros(max_batch, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        """The largest batch a step may have."""
        return self.buckets[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets whose graphs are captured (none on the CPU)."""
        return tuple(sorted(self._graphs))

    def accepts(self, seqs: Sequence[SeqInput]) -> bool:
        """This step can run here: every row feeds one token, none wants every logit, it fits."""
        if not 0 < len(seqs) <= self.max_batch:
            return False
        bs = self.block_size
        return all(len(s.tokens) == 1 and not s.all_logits and s.start // bs < self.max_pages for s in seqs)

    def bucket(self, n: int) -> int:
        """The smallest bucket holding `n` rows."""
        return next(b for b in self.buckets if b >= n)

    def capture(self) -> int:
        """Capture a graph per bucket (largest first, one shared memory pool); returns how many."""
        pool = None
        side = torch.cuda.Stream()
        for b in reversed(self.buckets):
            self._fill([SeqInput((0,), (0,), 0)], b)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, outside any capture
                self._step(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b] = self._step(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batches %s", self.captured)
        return len(self._graphs)

    def run(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """(n, vocab) float32 logits of one decode step (`accepts(seqs)` must hold).

        The result is a view of the graph's output: read it before the next step.
        """
        n = len(seqs)
        b = self.bucket(n)
        self._fill(seqs, b)
        graph = self._graphs.get(b)
        if graph is None:
            return self._step(b)[:n]
        graph.replay()
        return self._outputs[b][:n]

    def _fill(self, seqs: Sequence[SeqInput], padded_to: int) -> None:
        """Token ids and context of `seqs` into the static buffers, rows past len(seqs) = row 0."""
        n = len(seqs)
        host = self._host_tokens
        host[:n] = torch.tensor([s.tokens[0] for s in seqs], dtype=torch.int64)
        host[n:padded_to] = host[0]
        self.tokens[:padded_to].copy_(host[:padded_to], non_blocking=True)
        self.ctx.fill([SeqSlice(s.pages, s.start, 1) for s in seqs], padded_to)

    def _step(self, b: int) -> torch.Tensor:
        hidden = self.model(self.tokens[:b], self.ctx)  # (b, hidden)
        return self.model.head(hidden)  # (b, vocab) float32
