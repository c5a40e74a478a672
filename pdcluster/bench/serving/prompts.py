"""Prompt token ids for a workload: deterministic from the seed, shared where the trace says so (pure).

Traces give lengths, not text, so prompts are token ids drawn from `[FIRST_ID, vocab)` (ids below are
the tiny tokenizers' special tokens). A request with Mooncake `hash_ids` is built block by block:
block `h` is the same `block_tokens` ids wherever `h` appears (seeded by (seed, h)), so requests that
share leading ids share that prefix token for token, as in the traced service. Other requests get
ids seeded by (seed, request index).

    prompt([7, 9], 700) == block(7)[:512] + block(9)[:188]
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdcluster.bench.serving.traces import MOONCAKE_BLOCK_TOKENS
from pdcluster.bench.serving.workload import Arrival

FIRST_ID = 3


class PromptMaker:
    """Token ids of each request of one workload (one seed, one vocabulary)."""

    def __init__(self, seed: int, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        if vocab_size <= FIRST_ID:
            raise ValueError(f"vocabulary of {vocab_size} ids has no room for prompt tokens")
        self.seed = seed
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}
        self._vocab = range(FIRST_ID, vocab_size)

    def _ids(self, key: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")  # str seeds are hashed stably (not by PYTHONHASHSEED)
        return rng.choices(self._vocab, k=n)

    def block(self, hash_id: int) -> list[int]:
        """The tokens of prefix block `hash_id` (the same list every time)."""
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self._ids(f"block:{hash_id}", self.block_tokens)
        return self._blocks[hash_id]

    def prompt(self, index: int, arrival: Arrival) -> list[int]:
        """`arrival.input_len` ids for request `index`: its blocks' tokens, then its own."""
        ids: list[int] = []
        for hash_id in arrival.hash_ids:
            if len(ids) >= arrival.input_len:
                break
            ids.extend(self.block(hash_id))
        ids = ids[: arrival.input_len]
        if len(ids) < arrival.input_len:
            ids.extend(self._ids(f"request:{index}", arrival.input_len - len(ids)))
        return ids

    def warm_up_prompt(self, n: int) -> list[int]:
        """`n` ids no request of the workload starts with: a warm-up request that leaves nothing in a
        prefix cache that a measured request could find."""
        return self._ids("warm-up", n)

    def system_prompt(self, n: int) -> list[int]:
        """`n` ids every request of a shared-system-prompt load starts with."""
        return self._ids("system", n)

    def prompts(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """The prompt of every request, by index."""
        return [self.prompt(i, a) for i, a in enumerate(arrivals)]


def with_prefix(prompts: Sequence[Sequence[int]], prefix: Sequence[int]) -> list[list[int]]:
    """Each prompt with its first tokens replaced by `prefix` (lengths kept; a prompt shorter than
    the prefix is its start)."""
    return [list(prefix[: len(p)]) + list(p[len(prefix):]) for p in prompts]
