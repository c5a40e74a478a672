"""Deterministic tokens for a simulated replica: a function of the request's prompt and the step.

A request's token at step n is drawn from a 64-bit seed mixed from (a hash of its original prompt,
its sampling seed when it samples, n), so it is the same in any batch, on any replica, after a
migration or a re-run (a continuation's generated prefix does not change its original prompt), and
from run to run. EOS and special tokens are never drawn: a request ends at its `max_new_tokens`
(or a stop sequence), which is how serving benchmarks fix output lengths. Under a grammar the token
is the first one the grammar allows in the same order (EOS when only it is left), so constrained
output is valid here too.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from replica.engine.seeding import step_seed
from replica.engine.types import Choice, RowInput

_MASK64 = (1 << 64) - 1


def prompt_key(tokens: Sequence[int], prompt_len: int) -> int:
    """A 64-bit key of a prompt: its length and a few of its tokens (first, middle, last ones)."""
    if prompt_len <= 0:
        return 0
    picks = (tokens[0], tokens[1 % prompt_len], tokens[prompt_len // 2], tokens[prompt_len - 2],
             tokens[prompt_len - 1])
    return hash((prompt_len, picks)) & _MASK64  # ints and tuples of ints hash the same in every process


class TokenPicker:
    """Chooses tokens from the ordinary ids of the vocabulary (no EOS, no special token)."""

    def __init__(self, vocab_size: int, excluded: Iterable[int]) -> None:
        ids = array("I", range(vocab_size))
        for i in sorted({i for i in excluded if 0 <= i < vocab_size}, reverse=True):
            del ids[i]
        self.ids = ids
        if not self.ids:
            raise ValueError("the vocabulary has no ordinary token to generate")

    def _seed(self, row: RowInput) -> int:
        key = prompt_key(row.tokens, row.prompt_len)
        if row.params.do_sample and row.params.seed is not None:
            key ^= step_seed(row.params.seed, -1)
        return step_seed(key, row.num_generated)

    def choose(self, rows: Sequence[RowInput]) -> list[Choice]:
        """One token per row, with a deterministic log-probability and `top_n` alternatives."""
        ids, n = self.ids, len(self.ids)
        choices = []
        for row in rows:
            z = self._seed(row)
            token, logprob = ids[z % n], -((z >> 40) % 4096) / 1024.0
            if row.grammar is not None:  # structured output: the first allowed token in the same order
                token = row.grammar.first_allowed(ids, z % n)
            if row.top_n:
                alternatives = tuple(ids[(z + k) % n] for k in range(min(row.top_n, n)))
                values = tuple(logprob - k for k in range(len(alternatives)))
                choices.append(Choice(token, logprob, alternatives, values))
            else:
                choices.append(Choice(token, logprob))
        return choices
