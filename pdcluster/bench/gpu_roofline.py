"""The arithmetic of `pdcluster bench gpu`: bytes a decode step reads, FLOPs a prefill does, which
cells fit in the device's memory, and the goals. Pure Python (no torch), unit-tested with known numbers.

```
 ModelShape ──► decode_bytes(batch, context) ──► roofline s = bytes / measured copy B/s ─► time ratio
            ──► prefill_flops(tokens)         ──► achieved FLOP/s / measured matmul FLOP/s ─► ratio
            ──► plan_decode(batches, contexts, free bytes) ─► one DecodeCell per (context, batch):
                   fits, or skipped with the arithmetic that says why
```
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

GIB = 1 << 30

DECODE_BYTES_FORMULA = (
    "weight bytes read = dtype bytes x (layers x (hidden x (heads + 2 x kv_heads) x head_dim "
    "+ heads x head_dim x hidden + 3 x hidden x intermediate) + vocab x hidden) "
    "(every matrix once; the input embedding is a row lookup, not read whole, unless tied to the head; "
    "norms and biases left out, < 0.01 %); "
    "KV bytes read = batch x context x layers x 2 x kv_heads x head_dim x dtype bytes; "
    "roofline time = (weight bytes read + KV bytes read) / measured copy bandwidth "
    "(copy bandwidth = bytes read + bytes written / time of a device-to-device copy_)"
)
PREFILL_FLOPS_FORMULA = (
    "FLOPs = 2 x tokens x layers x (hidden x (heads + 2 x kv_heads) x head_dim + heads x head_dim x hidden "
    "+ 3 x hidden x intermediate) + 2 x hidden x vocab (the head runs on the last token only) "
    "+ 2 x 2 x layers x heads x head_dim x tokens x (tokens + 1) / 2 (causal QK^T and PV); "
    "ratio = (FLOPs / prefill time) / measured matmul FLOP/s"
)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a forward's bytes and FLOPs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def layer_matrix_params(self) -> int:
        """Parameters of one layer's matrices: q, k, v, o and the gated MLP's three."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        return qkv + out + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        """The lm_head's parameters (the embedding table when tied)."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every matrix parameter: layers, head, and the input embedding unless it is the head."""
        embed = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_matrix_params + self.head_params + embed

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


# Llama-2-7B: 6.74 B parameters, 12.55 GiB in bfloat16, 512 KiB of KV per token.
LLAMA_2_7B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                        vocab=32000)
# A shape the CPU runs in well under a second per cell (the benchmark's own tests).
TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
SHAPES = {"llama-2-7b": LLAMA_2_7B, "tiny": TINY}


def decode_weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Weight bytes one decode step reads (see `DECODE_BYTES_FORMULA`)."""
    return dtype_bytes * (shape.layers * shape.layer_matrix_params + shape.head_params)


def decode_kv_bytes(shape: ModelShape, dtype_bytes: int, batch: int, context: int) -> int:
    """KV bytes one decode step reads: every sequence's `context` tokens (the new one included)."""
    return batch * context * shape.kv_bytes_per_token(dtype_bytes)


def decode_roofline_s(shape: ModelShape, dtype_bytes: int, batch: int, context: int, copy_bytes_per_s: float
                      ) -> float:
    """The shortest a decode step can take: its bytes at the measured copy bandwidth."""
    read = decode_weight_bytes(shape, dtype_bytes) + decode_kv_bytes(shape, dtype_bytes, batch, context)
    return read / copy_bytes_per_s


def prefill_flops(shape: ModelShape, tokens: int) -> int:
    """FLOPs of one prefill of `tokens` fresh tokens (see `PREFILL_FLOPS_FORMULA`)."""
    linear = 2 * tokens * shape.layers * shape.layer_matrix_params + 2 * shape.head_params
    attention = 2 * 2 * shape.layers * shape.heads * shape.head_dim * tokens * (tokens + 1) // 2
    return linear + attention


def matmul_flops(n: int) -> int:
    """FLOPs of one (n x n) @ (n x n) matmul."""
    return 2 * n**3


# ------------------------------------------------------------------------------------- memory fit
@dataclass(frozen=True)
class DecodeCell:
    """One decode measurement: `batch` sequences with `context` tokens each (the new one included).

    `pages` are this cell's own (`ceil(context / block_size)` per sequence); `fits` says whether its
    cache fits in `budget` bytes, `reason` the arithmetic when it does not (or the position limit).
    """

    batch: int
    context: int
    pages: int
    kv_cache_bytes: int
    fits: bool
    reason: str = ""


def pages_per_sequence(context: int, block_size: int) -> int:
    """Pages holding `context` tokens."""
    return -(-context // block_size)


def plan_decode(shape: ModelShape, dtype_bytes: int, block_size: int, batches: Sequence[int],
                contexts: Sequence[int], budget_bytes: int, max_positions: int) -> list[DecodeCell]:
    """Every (context, batch) cell, in that order, each marked fitting or skipped with its arithmetic.

    `budget_bytes` is what the KV pages may take: the device's free memory after the weights, less
    a headroom for activations and graphs (the caller's). One cache per context is sized for the
    largest batch that fits, so a cell fits when its own pages do.
    """
    per_page = shape.kv_bytes_per_token(dtype_bytes) * block_size
    cells = []
    for context in contexts:
        for batch in batches:
            pages = batch * pages_per_sequence(context, block_size)
            size = pages * per_page
            reason = ""
            if context > max_positions:
                reason = f"context {context} > the model's max_position_embeddings {max_positions}"
            elif size > budget_bytes:
                reason = (f"KV of {batch} x {context} tokens = {pages} pages x {per_page} B = "
                          f"{size / GIB:.2f} GiB > {budget_bytes / GIB:.2f} GiB free for pages")
            cells.append(DecodeCell(batch, context, pages, size, not reason, reason))
    return cells


def cache_pages_per_context(cells: Sequence[DecodeCell]) -> dict[int, int]:
    """Pages of the one cache each context's fitting cells share (0: none fits)."""
    out: dict[int, int] = {}
    for cell in cells:
        out[cell.context] = max(out.get(cell.context, 0), cell.pages if cell.fits else 0)
    return out


def prefill_activation_bytes(shape: ModelShape, tokens: int) -> int:
    """A bound on a prefill's activations: per token the MLP's gate, up and product and a few hidden
    vectors, all counted in float32 (attention runs fused: no tokens x tokens matrix)."""
    return tokens * 4 * (3 * shape.intermediate + 8 * shape.hidden)


@dataclass(frozen=True)
class PrefillCell:
    """One prefill measurement of `tokens` fresh tokens; `fits` as `DecodeCell`'s."""

    tokens: int
    pages: int
    bytes_needed: int
    fits: bool
    reason: str = ""


def plan_prefill(shape: ModelShape, dtype_bytes: int, block_size: int, lengths: Sequence[int],
                 budget_bytes: int, max_positions: int) -> list[PrefillCell]:
    """Every prefill length, marked fitting (its pages and activations within `budget_bytes`) or
    skipped with the arithmetic."""
    per_page = shape.kv_bytes_per_token(dtype_bytes) * block_size
    cells = []
    for tokens in lengths:
        pages = pages_per_sequence(tokens, block_size)
        activations = prefill_activation_bytes(shape, tokens)
        need = pages * per_page + activations
        reason = ""
        if tokens > max_positions:
            reason = f"{tokens} tokens > the model's max_position_embeddings {max_positions}"
        elif need > budget_bytes:
            reason = (f"{pages} pages x {per_page} B + activations {activations} B "
                      f"= {need / GIB:.2f} GiB > {budget_bytes / GIB:.2f} GiB free")
        cells.append(PrefillCell(tokens, pages, need, not reason, reason))
    return cells


# ------------------------------------------------------------------------------------------ goals
class Verdict(enum.Enum):
    """A goal's outcome."""

    PASS = "pass"
    MISS = "miss"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Goal:
    """`value` compared with `limit`: at most (decode time ratios) or at least (prefill rate ratio)."""

    value: float | None
    limit: float
    at_most: bool

    @property
    def verdict(self) -> Verdict:
        """pass / miss, or skipped when the cell was not measured."""
        if self.value is None:
            return Verdict.SKIPPED
        met = self.value <= self.limit if self.at_most else self.value >= self.limit
        return Verdict.PASS if met else Verdict.MISS

    def to_json(self) -> dict[str, object]:
        """For the report."""
        return {"value": self.value, "limit": self.limit, "op": "<=" if self.at_most else ">=",
                "verdict": self.verdict.value}


DECODE_B1_GOAL = 1.25  # vLLM with CUDA graphs is about 1.2-1.3x on an H100
DECODE_B64_1K_GOAL = 1.5
PREFILL_2K_GOAL = 0.6
