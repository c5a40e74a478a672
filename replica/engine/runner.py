"""`ModelRunner`: one ragged forward of several sequences over the paged cache, layer by layer.

The engine hands it, per sequence, the tokens to feed, the pages and how many tokens are already
cached; it returns the logits of each sequence's last new token (and, on request, of every new
token for prompt log-probabilities). The layer loop is explicit so that a forward can later start
at layer k from a given activation, stop after layer k, or wait for a layer's weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replica.engine.backend import SeqInput
from replica.engine.memory import resized_cache
from replica.engine.sampling import choose_next
from replica.engine.types import Choice, RowInput
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice, as_int64
from replica.model.config import ModelConfig
from replica.model.llama import CausalLM

if TYPE_CHECKING:  # imported when first used: only the Triton decode path needs it
    from replica.engine.cuda_graphs import DecodeGraphs

__all__ = ["ForwardOutput", "ModelRunner", "SeqInput"]


@dataclass(frozen=True)
class ForwardOutput:
    """Last-token logits (seqs, vocab) and, where asked, every fed token's logits (length, vocab)."""

    last_logits: torch.Tensor
    all_logits: dict[int, torch.Tensor]


class ModelRunner:
    """Owns nothing but references: the model and the KV cache it writes into (`backend.Runner`)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, attention_backend: str = "torch") -> None:
        self.model = model
        self.cache = cache
        self.device = cache.tensor.device
        self.attention_backend = attention_backend
        # decode steps through static buffers (and CUDA graphs once captured); None: every step eager
        self.graphs: DecodeGraphs | None = None

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """The decode batch sizes replayed from CUDA graphs (none until `capture_graphs`)."""
        return () if self.graphs is None else self.graphs.captured

    def capture_graphs(self, max_batch: int) -> int:
        """Capture decode graphs for batches up to `max_batch` (CUDA and the triton backend only;
        returns the number of graphs, 0 where none can be captured)."""
        if self.device.type != "cuda" or self.attention_backend != "triton":
            return 0
        graphs = self.static_decoder(max_batch)
        with torch.inference_mode():
            count = graphs.capture()
        self.graphs = graphs
        return count

    def static_decoder(self, max_batch: int) -> DecodeGraphs:
        """Static decode buffers over this runner's cache, for batches up to `max_batch`."""
        from replica.engine.cuda_graphs import DecodeGraphs

        max_pages = -(-self.model.config.max_position_embeddings // self.cache.block_size)
        return DecodeGraphs(self.model, self.cache, max_batch, min(max_pages, self.cache.num_blocks))

    @property
    def num_layers(self) -> int:
        """Transformer layers of the model."""
        return self.model.config.num_layers

    @property
    def config(self) -> ModelConfig:
        """The model's hyper-parameters."""
        return self.model.config

    def inference(self) -> AbstractContextManager[object]:
        """torch's inference mode, around every forward."""
        return torch.inference_mode()

    def context(self, seqs: Sequence[SeqInput], token_ids: list[int] | None = None) -> AttentionContext:
        """The attention context of one forward (positions, page tables, masks); with `token_ids`
        they ride in its one host→device copy too (`ctx.token_ids`)."""
        slices = [SeqSlice(s.pages, s.start, len(s.tokens)) for s in seqs]
        config, backend = self.model.config, self.attention_backend
        return AttentionContext.build(self.cache, slices, config, backend, token_ids)

    def embed(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """(n, hidden) embeddings of every fed token, sequences concatenated."""
        flat = [t for s in seqs for t in s.tokens]
        return self.model.embed(as_int64(flat, self.device))

    def run_layers(self, hidden: torch.Tensor, ctx: AttentionContext, start: int, stop: int) -> torch.Tensor:
        """Layers [start, stop) on `hidden`; each writes its K/V of the new tokens into the pages."""
        for index in range(start, stop):
            hidden = self.model.layer_forward(index, hidden, ctx)
        return hidden

    def logits(self, hidden: torch.Tensor, ctx: AttentionContext, seqs: Sequence[SeqInput]) -> ForwardOutput:
        """Final norm + lm_head on each sequence's last token (and every token where asked)."""
        # one new token per sequence (a decode step): the last tokens are all of them, in order
        last = hidden if ctx.num_tokens == ctx.num_seqs else hidden.index_select(0, ctx.last_token_index)
        last = self.model.head(last)
        every: dict[int, torch.Tensor] = {}
        offset = 0
        for i, s in enumerate(seqs):
            if s.all_logits:
                every[i] = self.model.head(hidden[offset : offset + len(s.tokens)])
            offset += len(s.tokens)
        return ForwardOutput(last_logits=last, all_logits=every)

    def forward(self, seqs: Sequence[SeqInput]) -> ForwardOutput:
        """Embed, every layer, head."""
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.accepts(seqs):
                return ForwardOutput(last_logits=self.graphs.run(seqs), all_logits={})
            ctx = self.context(seqs, [t for s in seqs for t in s.tokens])
            assert ctx.token_ids is not None
            hidden = self.run_layers(self.model.embed(ctx.token_ids), ctx, 0, self.num_layers)
            return self.logits(hidden, ctx, seqs)

    def choose(self, out: ForwardOutput, rows: Sequence[RowInput]) -> list[Choice]:
        """Sample (or pick greedily) one token per sequence from its last logits."""
        return choose_next(out.last_logits, rows)

    def prompt_logprobs(self, out: ForwardOutput, index: int, prompt: Sequence[int]) -> list[float]:
        """Each prompt token's log-probability under the logits of the position before it."""
        logprobs = torch.log_softmax(out.all_logits[index][:-1].float(), dim=-1)
        ids = as_int64(list(prompt[1:]), logprobs.device).view(-1, 1)
        return [math.nan, *logprobs.gather(1, ids).view(-1).tolist()]

    def empty_activation(self, tokens: int) -> torch.Tensor:
        """(tokens, hidden) in the cache's dtype."""
        return torch.empty(
            (tokens, self.model.config.hidden_size), dtype=self.cache.tensor.dtype, device=self.device
        )

    def sendable(self, hidden: torch.Tensor) -> torch.Tensor:
        """A contiguous copy the fabric may read while the forward goes on."""
        return hidden.detach().clone().contiguous()

    def resized(self, fraction: float) -> ModelRunner | None:
        """A runner over a cache of `fraction` of the memory left (None: the page count stays)."""
        cache = resized_cache(self.cache, self.model.config, fraction)
        return None if cache is None else ModelRunner(self.model, cache, self.attention_backend)
