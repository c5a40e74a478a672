"""KV that arrives by migration enters the decode replica's prefix cache (issue 25 item 2, first half).

Two in-process replicas of the tiny Llama over tcp: P prefills and migrates (Migrate, PrefillV2
MIGRATE and MIGRATE_PROGRESSIVE) to D. Afterwards D's Info lists the PageHash of every full prompt
page it received, and a later prefill on D of a prompt extending one of them (the next turn of a
conversation) computes only the new tokens and still equals transformers; Generation.cached_tokens
says how many it took. Every replica's pages are all free or cached again after each test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protos import generate_pb2 as pb
from replica.kv.page_hash import page_hashes
from tests.helpers.migration_cluster import (
    CALL_TIMEOUT,
    Replica,
    decode_to_end,
    first_tokens,
    make_batch,
    migration_cluster,
    pair,
    random_prompts,
    reference,
)

BLOCK = 8
LENGTHS = [5, 16, 21]  # under a page, exactly two pages, two pages and five tokens
MAX_NEW = [4, 3, 5]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=2)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    with migration_cluster(
        model, tmp_path_factory.mktemp("mig"), 2, num_blocks=64, block_size=BLOCK
    ) as replicas:
        yield replicas


@pytest.fixture(autouse=True)
def pages_return(cluster: list[Replica]) -> Iterator[None]:
    yield
    for replica in cluster:
        info = replica.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        assert info.num_blocks_free == info.num_blocks_total and info.num_cached_batches == 0
        assert info.prefix_cache and info.num_blocks_cached <= info.num_blocks_total


def _move(p: Replica, d: Replica, batch: pb.Batch, how: str) -> tuple[pb.PrefillV2Response, pb.CachedBatch]:
    first, moved = _move_reporting(p, d, batch, how)
    return first, moved.batch


def _move_reporting(
    p: Replica, d: Replica, batch: pb.Batch, how: str
) -> tuple[pb.PrefillV2Response, pb.ImmigrateResponse]:
    def immigrate() -> pb.ImmigrateResponse:
        request = pb.ImmigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
        return d.stub.Immigrate(request, timeout=CALL_TIMEOUT)

    if how == "migrate":
        first = p.stub.PrefillV2(
            pb.PrefillV2Request(batch=batch, forward_case=pb.NORMAL), timeout=CALL_TIMEOUT
        )
        migrate = pb.MigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
        _, cached = pair(lambda: p.stub.Migrate(migrate, timeout=CALL_TIMEOUT), immigrate)
        return first, cached
    case = pb.MIGRATE if how == "prefill-migrate" else pb.MIGRATE_PROGRESSIVE
    request = pb.PrefillV2Request(batch=batch, forward_case=case, pipe_peer=[d.rank])
    return pair(lambda: p.stub.PrefillV2(request, timeout=CALL_TIMEOUT), immigrate)


@pytest.mark.parametrize("how", ["migrate", "prefill-migrate", "progressive"])
def test_migrated_pages_are_cached_on_the_receiver(cluster: list[Replica], model: Path, how: str) -> None:
    p, d = cluster
    seed = {"migrate": 1, "prefill-migrate": 2, "progressive": 3}[how]
    prompts = random_prompts(256, LENGTHS, seed=seed)
    batch = make_batch(10 + seed, prompts, MAX_NEW, first_id=100 * seed)
    first, cached = _move(p, d, batch, how)
    tokens = first_tokens(first.generations)
    got = decode_to_end(d, cached, tokens, [tokens[r][0] for r in cached.request_ids])
    want = reference(model, prompts, MAX_NEW)
    assert [got[100 * seed + i] for i in range(len(prompts))] == want

    kept = set(d.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).cached_page_hashes)
    for prompt in prompts:
        assert set(page_hashes(prompt, BLOCK)) <= kept  # every full prompt page the migration wrote

    # the conversation's next turn on D: the migrated prompt's full pages are not computed again
    turn2 = prompts[2] + want[2] + [40, 41, 42]  # (an EOS first would differ: the reference masks it)
    request = make_batch(20 + seed, [turn2], [4], first_id=100 * seed + 50)
    reply = d.stub.PrefillV2(pb.PrefillV2Request(batch=request, forward_case=pb.NORMAL), timeout=CALL_TIMEOUT)
    [generation] = reply.generations
    assert generation.cached_tokens >= len(page_hashes(prompts[2], BLOCK)) * BLOCK
    tokens2 = first_tokens(reply.generations)
    if reply.HasField("batch"):
        tokens2 = decode_to_end(d, reply.batch, tokens2, None)
    assert tokens2[100 * seed + 50] == reference(model, [turn2], [4])[0]


@pytest.mark.parametrize("how", ["migrate", "prefill-migrate", "progressive"])
def test_the_next_turn_moves_only_the_pages_the_receiver_lacks(
    cluster: list[Replica], model: Path, how: str
) -> None:
    p, d = cluster
    seed = {"migrate": 11, "prefill-migrate": 12, "progressive": 13}[how]
    [turn1, other] = random_prompts(256, [21, 12], seed=seed)  # 2 full pages + 5 tokens; 1 page + 4
    first, moved = _move_reporting(p, d, make_batch(30 + seed, [turn1], [3], first_id=1000 * seed), how)
    assert moved.reused_tokens == 0 and list(moved.request_reused_tokens) == [0]
    tokens = first_tokens(first.generations)
    decode_to_end(d, moved.batch, tokens, [tokens[r][0] for r in moved.batch.request_ids])

    # the next turn extends turn 1 (its two full pages are cached on D); `other` shares nothing
    turn2 = [*turn1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]
    batch = make_batch(40 + seed, [turn2, other], [4, 4], first_id=1000 * seed + 10)
    first, moved = _move_reporting(p, d, batch, how)
    assert list(moved.request_reused_tokens) == [2 * BLOCK, 0] and moved.reused_tokens == 2 * BLOCK
    tokens = first_tokens(first.generations)
    got = decode_to_end(d, moved.batch, tokens, [tokens[r][0] for r in moved.batch.request_ids])
    assert [got[1000 * seed + 10], got[1000 * seed + 11]] == reference(model, [turn2, other], [4, 4])


def test_a_receiver_without_the_prefix_cache_reuses_nothing(
    model: Path, tmp_path: Path
) -> None:
    no_cache = {1: {"prefix_cache": False}}
    with migration_cluster(model, tmp_path, 2, no_cache, num_blocks=64, block_size=BLOCK) as (p, d):
        [prompt] = random_prompts(256, [24], seed=21)
        for turn in range(2):  # the second time the same prompt still moves whole
            batch = make_batch(50 + turn, [prompt], [2], first_id=500 + turn)
            first, moved = _move_reporting(p, d, batch, "migrate")
            assert moved.reused_tokens == 0
            tokens = first_tokens(first.generations)
            got = decode_to_end(d, moved.batch, tokens, [tokens[r][0] for r in moved.batch.request_ids])
            assert got[500 + turn] == reference(model, [prompt], [2])[0]
