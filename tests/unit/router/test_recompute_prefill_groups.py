"""A recompute re-prefill (prompt + first token per request) is cut to the prefill token budget."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from router.batches import prefill_groups


def _member(prompt_len: int) -> Any:
    return SimpleNamespace(request=SimpleNamespace(input_ids=tuple(range(prompt_len))))


def test_groups_keep_order_and_fit_the_budget_a_too_large_prompt_goes_alone() -> None:
    members = [_member(129) for _ in range(32)] + [_member(5000), _member(10)]
    groups = prefill_groups(members, 4096)
    assert [m for g in groups for m in g] == members
    assert [len(g) for g in groups] == [31, 1, 1, 1]
    assert all(sum(len(m.request.input_ids) for m in g) <= 4096 for g in groups if len(g) > 1)
