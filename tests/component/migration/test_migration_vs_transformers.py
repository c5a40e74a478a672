"""KV migration between in-process replicas, checked token for token against transformers.

Three replicas of the tiny Llama (4 layers, so a partial split has two real halves) share one rank
table with tcp fabrics on loopback. Every scenario prefills on one replica, moves the KV, decodes
on another, and compares every generated token with transformers' greedy `generate`; afterwards
every replica's free page count is back where it started.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protos import generate_pb2 as pb
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

LENGTHS = [1, 7, 16, 17, 40]  # page boundaries at 8: partial, exact and multi-page prompts
MAX_NEW = [6, 3, 9, 1, 5]
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    with migration_cluster(model, tmp_path_factory.mktemp("mig"), 3, num_blocks=96, block_size=8) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def expected(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(256, LENGTHS)
    return prompts, reference(model, prompts, MAX_NEW)


@pytest.fixture(autouse=True)
def pages_return(cluster: list[Replica]) -> Iterator[None]:
    before = [r.free_blocks() for r in cluster]
    assert before == [r.total_blocks() for r in cluster]
    yield
    assert [r.free_blocks() for r in cluster] == before


def _prefill(
    replica: Replica, batch: pb.Batch, case: int = pb.NORMAL, peer: int | None = None
) -> pb.PrefillV2Response:
    request = pb.PrefillV2Request(batch=batch, forward_case=case, pipe_peer=[] if peer is None else [peer])
    return replica.stub.PrefillV2(request, timeout=CALL_TIMEOUT)


def _immigrate(replica: Replica, batch: pb.Batch, src: int) -> pb.CachedBatch:
    request = pb.ImmigrateRequest(batch=batch, src=[src], dst=[replica.rank])
    return replica.stub.Immigrate(request, timeout=CALL_TIMEOUT).batch


def _finish(d: Replica, cached: pb.CachedBatch, first: pb.PrefillV2Response) -> dict[int, list[int]]:
    tokens = first_tokens(first.generations)
    last = [tokens[r][0] for r in cached.request_ids]  # appended tokens come back with no ids
    return decode_to_end(d, cached, tokens, last)


def _check(got: dict[int, list[int]], expected: tuple[list[list[int]], list[list[int]]], base: int) -> None:
    _, want = expected
    for i, tokens in enumerate(want):
        assert got[base + i] == tokens, f"request {i} (prompt of {LENGTHS[i]} tokens)"


def test_prefill_migrate_then_decode(
    cluster: list[Replica], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    p, d = cluster[0], cluster[2]
    batch = make_batch(11, expected[0], MAX_NEW, first_id=100)
    first = _prefill(p, batch)
    migrated, cached = pair(
        lambda: p.stub.Migrate(
            pb.MigrateRequest(batch=batch, src=[p.rank], dst=[d.rank]), timeout=CALL_TIMEOUT
        ),
        lambda: _immigrate(d, batch, p.rank),
    )
    assert migrated.batch.id == 11 and list(migrated.batch.request_ids) == [100 + i for i in range(5)]
    assert cached.id == 11 and cached.max_tokens == first.batch.max_tokens
    info = p.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
    assert info.num_cached_batches == 0 and info.fabric == "tcp"  # the router refuses to mix fabrics
    _check(_finish(d, cached, first), expected, 100)


@pytest.mark.parametrize("case", [pb.MIGRATE, pb.MIGRATE_PROGRESSIVE], ids=["migrate", "progressive"])
def test_prefill_v2_moves_kv_to_pipe_peer(
    cluster: list[Replica], expected: tuple[list[list[int]], list[list[int]]], case: int
) -> None:
    p, d = cluster[1], cluster[0]
    batch = make_batch(20 + case, expected[0], MAX_NEW, first_id=200)
    first, cached = pair(lambda: _prefill(p, batch, case, d.rank), lambda: _immigrate(d, batch, p.rank))
    assert first.batch.id == batch.id and cached.id == batch.id
    assert p.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_cached_batches == 0
    _check(_finish(d, cached, first), expected, 200)


def test_partial_halves_from_two_senders(
    cluster: list[Replica], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    a, b, d = cluster
    batch = make_batch(31, expected[0], MAX_NEW, first_id=300)
    first = _prefill(a, batch)
    assert first_tokens(_prefill(b, batch).generations) == first_tokens(first.generations)

    def half(sender: Replica, case: pb.PartialCase) -> Callable[[], pb.MigrateResponse]:
        request = pb.MigratePartialRequest(
            batch=batch, fst_or_snd=case, num_layer=1, src=[sender.rank], dst=[d.rank]
        )
        return lambda: sender.stub.MigratePartial(request, timeout=CALL_TIMEOUT)

    def receive(sender: Replica, case: pb.PartialCase) -> Callable[[], pb.ImmigrateResponse]:
        request = pb.ImmigratePartialRequest(
            batch=batch, fst_or_snd=case, num_layer=1, src=[sender.rank], dst=[d.rank]
        )
        return lambda: d.stub.ImmigratePartial(request, timeout=CALL_TIMEOUT)

    # SECOND's calls start first: the receiver's SECOND must wait for FIRST's batch
    (_, second), ((_, first_half)) = pair(
        lambda: pair(half(b, pb.PARTIAL_CASE_SECOND), receive(b, pb.PARTIAL_CASE_SECOND)),
        lambda: pair(half(a, pb.PARTIAL_CASE_FIRST), receive(a, pb.PARTIAL_CASE_FIRST)),
    )
    assert first_half.batch.id == second.batch.id == 31
    _check(_finish(d, second.batch, first), expected, 300)


def test_connect_peers_sets_up_every_stream_on_both_ends_and_refuses_a_rank_not_in_the_table(
    cluster: list[Replica], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    import grpc

    p, d = cluster[0], cluster[1]
    first, second = pair(
        lambda: p.stub.ConnectPeers(pb.ConnectPeersRequest(peers=[d.rank]), timeout=CALL_TIMEOUT),
        lambda: d.stub.ConnectPeers(pb.ConnectPeersRequest(peers=[p.rank]), timeout=CALL_TIMEOUT),
    )
    assert [(link.rank, link.error) for link in first.links] == [(d.rank, "")]
    assert [(link.rank, link.error) for link in second.links] == [(p.rank, "")]
    assert first.links[0].connect_ms > 0
    with pytest.raises(grpc.RpcError) as refused:
        p.stub.ConnectPeers(pb.ConnectPeersRequest(peers=[p.rank, 999]), timeout=CALL_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "999" in (refused.value.details() or "")
    # the warmed connections carry the next migration as before
    batch = make_batch(31, expected[0], MAX_NEW, first_id=300)
    first_reply, cached = pair(lambda: _prefill(p, batch, pb.MIGRATE, d.rank),
                               lambda: _immigrate(d, batch, p.rank))
    _check(_finish(d, cached, first_reply), expected, 300)


@pytest.mark.parametrize("case", [pb.MIGRATE, pb.MIGRATE_PROGRESSIVE], ids=["migrate", "progressive"])
def test_a_chunked_prefill_streams_each_chunks_pages(
    model: Path, tmp_path: Path, expected: tuple[list[list[int]], list[list[int]]], case: int
) -> None:
    """The sender prefills in chunks of 16 tokens (`--max-batch-prefill-tokens`; the batch has 81):
    PROGRESSIVE sends each forward's layers as made, the pages that forward completed; tokens equal
    transformers. The same prompts again: the receiver holds their full pages, only the rest moves."""
    chunked = {0: {"max_batch_prefill_tokens": 16}}
    with migration_cluster(model, tmp_path, 2, chunked, num_blocks=96, block_size=8) as (p, d):
        for attempt in range(2):
            base = 300 + 10 * attempt
            batch = make_batch(30 + attempt, expected[0], MAX_NEW, first_id=base)
            first, cached = pair(functools.partial(_prefill, p, batch, case, d.rank),
                                 functools.partial(_immigrate, d, batch, p.rank))
            _check(_finish(d, cached, first), expected, base)
        for replica in (p, d):
            assert replica.free_blocks() == replica.total_blocks()
