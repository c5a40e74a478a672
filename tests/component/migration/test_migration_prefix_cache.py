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
    def immigrate() -> pb.CachedBatch:
        request = pb.ImmigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
        return d.stub.Immigrate(request, timeout=CALL_TIMEOUT).batch

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
