"""The batched sampler's tensor stages: penalties and warpers over (rows, vocab), the race's noise.

Each is the per-row reference of `sampling.py` with per-row parameters as (rows, 1) tensors (a row
whose filter is off gets a value that drops nothing), so one call serves a whole mixed batch.
"""

from __future__ import annotations

import functools

import torch

from replica.engine.finite import saturate
from replica.engine.seeding import MASK32, MIX32, WEYL32

_NEG_INF = float("-inf")


def repetition_rows(scores: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """CTRL penalty on (n, vocab) `scores` for the ids in `seen` (n, L; the id `vocab` is padding)."""
    n, vocab = scores.shape
    mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, seen, True)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return saturate(torch.where(mask[:, :vocab], penalised, scores), scores)  # overflow saturates


def frequency_rows(
    scores: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor, output: torch.Tensor
) -> torch.Tensor:
    """OpenAI penalties on (n, vocab) `scores` from the generated ids `output` (n, L; `vocab` pads)."""
    n, vocab = scores.shape
    ones = torch.ones(output.shape, dtype=scores.dtype, device=scores.device)
    counts = torch.zeros(n, vocab + 1, dtype=scores.dtype, device=scores.device).scatter_add_(1, output, ones)
    counts = counts[:, :vocab]
    penalised = scores - counts * frequency - (counts > 0).to(scores.dtype) * presence
    return saturate(penalised, scores)  # overflow saturates (finite.py)


def top_k_rows(scores: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep each row's k highest scores (k (n, 1) in [1, vocab]; 0 = keep all); -inf elsewhere."""
    highest = torch.topk(scores, k_max, dim=-1).values  # (n, k_max), descending
    threshold = highest.gather(1, (k - 1).clamp(min=0)).masked_fill(k == 0, _NEG_INF)
    return scores.masked_fill(scores < threshold, _NEG_INF)


def top_p_rows(scores: torch.Tensor, drop_mass: torch.Tensor) -> torch.Tensor:
    """Nucleus filter per row: drop the least likely tokens whose total mass is at most `drop_mass` (n, 1)."""
    ascending, order = torch.sort(scores, dim=-1)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_below <= drop_mass
    drop_sorted[:, -1:] = False  # the most likely token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, _NEG_INF)


def typical_rows(scores: torch.Tensor, mass: torch.Tensor | float) -> torch.Tensor:
    """Locally typical filter per row: keep the tokens closest to the entropy until `mass` ((n, 1),
    or one number for every row) is covered."""
    logp = torch.log_softmax(scores, dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    distance = (-logp - entropy).abs()
    by_distance, order = torch.sort(distance, dim=-1)
    covered = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (covered < mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    drop_sorted = by_distance > by_distance.gather(-1, last)
    drop_sorted[..., :1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, _NEG_INF)


@functools.lru_cache(maxsize=8)
def _vocab_indices(vocab: int, device: torch.device) -> torch.Tensor:
    """(vocab,) int64 0..vocab-1, kept per device: the race's counters."""
    return torch.arange(vocab, dtype=torch.int64, device=device)


def race_bits(keys: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(n, len(indices)) int64 `seeding.race_bits` of every (step seed, index) pair, as tensor ops.

    `keys` (n, 2) holds the (low, high) 32-bit words of the step seeds, `indices` are below 2^31: every
    value stays below 2^63 (32-bit words times multipliers below 2^31), so no op overflows."""
    x = ((indices * WEYL32) & MASK32) ^ keys[:, 1:]
    x += keys[:, :1]
    x &= MASK32
    x ^= x >> 16
    x *= MIX32[0]
    x &= MASK32
    x ^= x >> 15
    x *= MIX32[1]
    x &= MASK32
    x ^= x >> 15
    return x


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(n, vocab) float64 Exp(1) noise for the step seeds' `keys` (n, 2), one value per token."""
    bits = race_bits(keys, _vocab_indices(vocab, keys.device))
    # u in (0, 1) exactly (a 33-bit numerator fits a double), so E = -log(u) is finite and > 0
    uniform = (bits.to(torch.float64) + 0.5) * 2.0**-32
    return uniform.log_().neg_()
