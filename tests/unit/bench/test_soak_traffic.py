"""The soak's token-id prompts stay inside the served model's vocabulary (a 300-token checkpoint
got ids up to 499 before, and the refusals counted as failures)."""

from __future__ import annotations

import random

import pytest

from pdcluster.bench.soak.traffic import plan, prompt_ids


@pytest.mark.parametrize("vocab", [4, 300, 32000])
def test_completion_prompts_are_drawn_below_the_vocabulary(vocab: int) -> None:
    rng = random.Random(7)
    prompts = [p.body["prompt"] for p in (plan(rng, "m", vocab) for _ in range(2000))
               if p.kind == "completion"]
    ids = [i for prompt in prompts for i in prompt]
    assert prompts and min(ids) >= 0 and max(ids) < vocab
    assert max(ids) >= min(vocab, 500) - 5  # the range is used, not a corner of it


def test_a_vocabulary_that_is_unknown_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary size must be > 0"):
        prompt_ids(random.Random(1), 0)
