"""Tokens a request must not choose at this step (`RowInput.banned`): the EOS tokens before its
`min_new_tokens` are generated (stopping.StopChecker.banned).

They go to -inf after the grammar's mask and before every other stage, so no bias or penalty brings
them back, on the CPU path and the batched one alike. A row the ban would leave without any finite
logit (a grammar that allows only EOS here) keeps its logits: a token must be chosen, and the
grammar's end wins over min_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica.engine.types import RowInput


def without_banned(logits: torch.Tensor, rows: Sequence[RowInput]) -> torch.Tensor:
    """`logits` (batch, vocab) with each row's banned ids at -inf (a copy when any row bans; the same
    tensor when none does)."""
    which = [i for i, inp in enumerate(rows) if inp.banned]
    if not which:
        return logits
    out = logits.clone()
    for i in which:
        row = out[i].index_fill(0, torch.tensor(rows[i].banned, device=out.device), float("-inf"))
        if bool(torch.isfinite(row).any()):
            out[i] = row
    return out
