"""Per-rank KV migration variants (`long`): a model with fewer KV heads than ranks (each rank holds
a copy of its KV head: every copy moves, rank to rank) between two `--tp 2` groups, and a tp 4 pair
(ranks 0-3 → 4-7), each followed by transformers' greedy tokens on the receiver."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from protos import generate_pb2 as pb
from tests.helpers.migration_cluster import (
    decode_to_end,
    first_tokens,
    make_batch,
    pair,
    random_prompts,
    reference,
)
from tests.helpers.tp_replicas import TIMEOUT, Group, tp_replicas

pytestmark = pytest.mark.long
LENGTHS = [3, 9, 14]
MAX_NEW = [4, 2, 5]


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 1), (4, 2)])
def test_migration_decodes_transformers_tokens(
    tp: int, kv_heads: int, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory(arch="qwen2", kv_heads=kv_heads, heads=4, seed=51)
    with tp_replicas(model, tmp_path, [Group(0, tp), Group(tp, tp)]) as (a, b):
        prompts = random_prompts(256, LENGTHS, seed=13)
        batch = make_batch(1, prompts, MAX_NEW)
        first = a.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)
        _, got = pair(
            lambda: a.stub.Migrate(pb.MigrateRequest(batch=batch, src=[0], dst=[tp]), timeout=TIMEOUT),
            lambda: b.stub.Immigrate(pb.ImmigrateRequest(batch=batch, src=[0], dst=[tp]), timeout=TIMEOUT),
        )
        tokens = first_tokens(first.generations)
        last = [tokens[r][0] for r in got.batch.request_ids]
        decoded = decode_to_end(cast(Any, b), got.batch, tokens, last)
        assert [decoded[i] for i in range(len(prompts))] == reference(model, prompts, MAX_NEW)
        for proc in (a, b):
            proc.check_all_free()
