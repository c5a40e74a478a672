"""Refused and concurrent migrations between in-process replicas: precise codes, nothing leaked.

- Immigrate of a batch id already cached → ALREADY_EXISTS; Migrate of an unknown batch → NOT_FOUND.
- Two replicas whose KV layouts differ (block size) → FAILED_PRECONDITION on both sides, before a
  byte of KV moves; both keep their page counts.
- Two migrations between the same pair at once, their calls arriving in opposite orders on the two
  sides → both succeed (serialised) and decode exactly like transformers.
- A receiver that refuses the sender's header (bytes differ) → FAILED_PRECONDITION there, the sender
  UNAVAILABLE at once (its FAILED ack), and the pair's next migration works.
- An Immigrate that ends at its deadline or is cancelled before its sender came leaves the pair's
  connection up (the next migration works the first time); a sender that comes after all fails
  UNAVAILABLE as soon as the next Immigrate from it reads (and refuses) its header.
- A sender that gave up (resetting the pair's KV connections) leaves migrations the other way working.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from protos import generate_pb2 as pb
from tests.helpers.eventually import eventually
from tests.helpers.migration_cluster import (
    CALL_TIMEOUT,
    Replica,
    code_and_cause,
    decode_to_end,
    first_tokens,
    make_batch,
    migration_cluster,
    pair,
    random_prompts,
    reference,
)


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    # rank 2's pages hold 16 tokens, not 8: its KV layout differs from ranks 0 and 1
    with migration_cluster(
        tiny_llama,
        tmp_path_factory.mktemp("migf"),
        3,
        per_rank={2: {"block_size": 16}},
        num_blocks=64,
        block_size=8,
        transfer_timeout=20.0,
    ) as replicas:
        yield replicas


@pytest.fixture(autouse=True)
def pages_return(cluster: list[Replica]) -> Iterator[None]:
    before = [r.free_blocks() for r in cluster]
    assert before == [r.total_blocks() for r in cluster]
    yield
    assert [r.free_blocks() for r in cluster] == before


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _prefill(replica: Replica, batch: pb.Batch) -> pb.PrefillV2Response:
    return replica.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=CALL_TIMEOUT)


def _migrate(sender: Replica, batch: pb.Batch, receiver: Replica) -> Callable[[], pb.MigrateResponse]:
    request = pb.MigrateRequest(batch=batch, src=[sender.rank], dst=[receiver.rank])
    return lambda: sender.stub.Migrate(request, timeout=CALL_TIMEOUT)


def _immigrate(receiver: Replica, batch: pb.Batch, sender: Replica) -> Callable[[], pb.ImmigrateResponse]:
    request = pb.ImmigrateRequest(batch=batch, src=[sender.rank], dst=[receiver.rank])
    return lambda: receiver.stub.Immigrate(request, timeout=CALL_TIMEOUT)


def test_present_and_unknown_batch_ids(cluster: list[Replica]) -> None:
    p, d = cluster[0], cluster[1]
    batch = make_batch(40, random_prompts(256, [9, 3]), [4, 4])
    _prefill(d, batch)
    assert _code(_immigrate(d, batch, p)) == grpc.StatusCode.ALREADY_EXISTS
    assert _code(_migrate(p, batch, d)) == grpc.StatusCode.NOT_FOUND
    d.stub.ClearCache(pb.ClearCacheRequest(id=40), timeout=CALL_TIMEOUT)


def test_layout_mismatch_fails_both_sides(cluster: list[Replica]) -> None:
    p, d = cluster[0], cluster[2]
    batch = make_batch(41, random_prompts(256, [20, 5]), [3, 3])
    _prefill(p, batch)
    with ThreadPoolExecutor(2) as pool:
        sent, received = (
            pool.submit(_code, _migrate(p, batch, d)),
            pool.submit(_code, _immigrate(d, batch, p)),
        )
        assert sent.result(CALL_TIMEOUT) == grpc.StatusCode.FAILED_PRECONDITION
        assert received.result(CALL_TIMEOUT) == grpc.StatusCode.FAILED_PRECONDITION
    # the sender's batch is gone (its pages freed): the migration consumed it
    assert p.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_cached_batches == 0


def test_concurrent_migrations_between_one_pair_are_serialised(
    cluster: list[Replica], tiny_llama: Path
) -> None:
    p, d = cluster[0], cluster[1]
    lengths, max_new = [30, 12, 50], [5, 7, 4]
    x = make_batch(50, random_prompts(256, lengths, seed=1), max_new, first_id=500)
    y = make_batch(51, random_prompts(256, lengths, seed=2), max_new, first_id=510)
    firsts = {b.id: _prefill(p, b) for b in (x, y)}
    # the sender sees x then y; the receiver's calls come in the opposite order
    calls = [_immigrate(d, y, p), _migrate(p, x, d), _immigrate(d, x, p), _migrate(p, y, d)]
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(call) for call in calls]
        received = [f.result(CALL_TIMEOUT) for f in results[0::2]]
        cached = {r.batch.id: r.batch for r in received if isinstance(r, pb.ImmigrateResponse)}
    for batch, base in ((x, 500), (y, 510)):
        tokens = first_tokens(firsts[batch.id].generations)
        last = [tokens[r][0] for r in cached[batch.id].request_ids]
        got = decode_to_end(d, cached[batch.id], tokens, last)
        prompts = [list(r.input_tokens) for r in batch.requests]
        for i, want in enumerate(reference(tiny_llama, prompts, max_new)):
            assert got[base + i] == want, f"batch {batch.id} request {i}"


def test_pair_helper_raises_the_first_error(cluster: list[Replica]) -> None:
    # an Immigrate naming this replica as its own source is refused before anything is allocated
    d = cluster[1]
    batch = make_batch(60, random_prompts(256, [4]), [2])
    assert _code(lambda: pair(_immigrate(d, batch, d), lambda: None)) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_immigrate_nobody_sends_to_ends_at_its_deadline_or_when_cancelled(
    cluster: list[Replica], tiny_llama: Path
) -> None:
    p, d = cluster[0], cluster[1]
    _migrates_correctly(p, d, tiny_llama, 71)  # the pair's KV connection is up
    total = d.total_blocks()
    batch = make_batch(70, random_prompts(256, [30]), [4])
    request = pb.ImmigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        d.stub.Immigrate(request, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5.0
    eventually(lambda: d.free_blocks() == total)

    call = d.stub.Immigrate.future(request, timeout=CALL_TIMEOUT)
    eventually(lambda: d.free_blocks() < total)  # admitted: its pages are allocated, it waits for a header
    call.cancel()
    eventually(lambda: d.free_blocks() == total, timeout=5.0)  # far sooner than --transfer-timeout
    # giving up left the pair's connection as it was: the next migration works the first time
    _migrates_correctly(p, d, tiny_llama, 72)


def test_a_late_sender_of_an_abandoned_batch_fails_at_once_and_the_next_migration_works(
    cluster: list[Replica], tiny_llama: Path
) -> None:
    p, d = cluster[0], cluster[1]
    late = make_batch(73, random_prompts(256, [24], seed=5), [3], first_id=730)
    with pytest.raises(grpc.RpcError) as info:  # the receiver gives up before the sender comes
        d.stub.Immigrate(pb.ImmigrateRequest(batch=late, src=[p.rank], dst=[d.rank]), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _prefill(p, late)
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(code_and_cause, _migrate(p, late, d))  # comes after all: its header waits at d
        eventually(lambda: p.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_cached_batches == 0)
        time.sleep(0.1)  # taken out of p's store: its header goes out now
        # the next Immigrate from p reads the late header first, refuses it (its sender fails at
        # once, not at its 20 s deadline) and then receives its own batch
        _migrates_correctly(p, d, tiny_llama, 74)
        assert sent.result(CALL_TIMEOUT) == (grpc.StatusCode.UNAVAILABLE, "peer")  # p is fine: d refused
    assert time.monotonic() - start < 10


def test_a_sender_that_gives_up_leaves_the_pairs_migrations_the_other_way_working(
    cluster: list[Replica], tiny_llama: Path
) -> None:
    a, b = cluster[0], cluster[1]
    _migrates_correctly(a, b, tiny_llama, 90)  # a -> b is connected
    lone = make_batch(91, random_prompts(256, [16], seed=9), [3], first_id=910)
    _prefill(b, lone)
    request = pb.MigrateRequest(batch=lone, src=[b.rank], dst=[a.rank])
    with pytest.raises(grpc.RpcError) as info:  # nobody receives it: b gives up, resetting its end
        b.stub.Migrate(request, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # b's reset also dropped the a -> b connection; a replaces it before its next header
    _migrates_correctly(a, b, tiny_llama, 92)


def _migrates_correctly(p: Replica, d: Replica, tiny_llama: Path, batch_id: int) -> None:
    """Prefill one request on `p`, migrate it to `d` (first try), decode it there like transformers."""
    first_id = batch_id * 10
    batch = make_batch(batch_id, random_prompts(256, [20], seed=batch_id), [3], first_id=first_id)
    first = first_tokens(_prefill(p, batch).generations)
    got = pair(_migrate(p, batch, d), _immigrate(d, batch, p))[1]
    tokens = decode_to_end(d, got.batch, first, [first[r][0] for r in got.batch.request_ids])
    assert tokens[first_id] == reference(tiny_llama, [list(batch.requests[0].input_tokens)], [3])[0]


def test_a_receiver_that_refuses_fails_its_sender_at_once_and_the_pair_works_afterwards(
    cluster: list[Replica], tiny_llama: Path
) -> None:
    # the receiver is told a longer prompt than the sender holds: it refuses the header (bytes differ)
    # and acknowledges FAILED; the sender fails UNAVAILABLE well before its deadline, resets its end
    # of the KV stream (the receiver reset its own), and the pair's next migration succeeds.
    p, d = cluster[0], cluster[1]
    held = make_batch(80, random_prompts(256, [20], seed=3), [3], first_id=800)
    claimed = make_batch(80, random_prompts(256, [36], seed=3), [3], first_id=800)
    _prefill(p, held)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(code_and_cause, _migrate(p, held, d))
        received = pool.submit(_code, _immigrate(d, claimed, p))
        assert received.result(CALL_TIMEOUT) == grpc.StatusCode.FAILED_PRECONDITION
        assert sent.result(CALL_TIMEOUT) == (grpc.StatusCode.UNAVAILABLE, "peer")  # p is fine: d refused
    assert time.monotonic() - start < 10  # the transfer timeout is 20 s
    _migrates_correctly(p, d, tiny_llama, 81)
