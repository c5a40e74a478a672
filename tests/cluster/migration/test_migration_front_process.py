"""KV migration between `pdcluster replica` subprocesses that serve gRPC from their front process, whose
forwarded calls (Migrate, Immigrate, LoadParams, ...) reach the servicer over the service channel.

- A batch migrated between two front-process replicas decodes exactly like transformers.
- Statuses of forwarded calls equal the single-process server's (`--no-grpc-frontend`), code and text.
- An Immigrate nobody sends to ends at its deadline (DEADLINE_EXCEEDED, in time) or when its caller
  cancels (the servicer's end callback stops the receiver), and its pages come back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.eventually import eventually
from tests.helpers.migration_cluster import make_batch, random_prompts, reference, write_rank_table

NUM_BLOCKS = 64
DEADLINE = 30.0
FRONT, SINGLE = (0, 1), 2  # ranks served through a front process, and the one without


class _Rank:
    """A replica subprocess of the rank table and a stub on its public port."""

    def __init__(self, rank: int, process: ReplicaProcess) -> None:
        self.rank = rank
        self.process = process
        self.channel = grpc.insecure_channel(process.address)
        self.stub = pb_grpc.TextGenerationServiceStub(self.channel)

    def free_blocks(self) -> int:
        return self.stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_blocks_free


@pytest.fixture(scope="module")
def ranks(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[_Rank]]:
    table = write_rank_table(tmp_path_factory.mktemp("front-migration") / "ranks.json", 3)

    def start(rank: int) -> ReplicaProcess:
        extra = ["--no-grpc-frontend"] if rank == SINGLE else []
        return ReplicaProcess.start(
            tiny_llama, "--rank", str(rank), "--cluster", str(table), "--num-blocks", str(NUM_BLOCKS),
            "--transfer-timeout", "20", "--torch-threads", "1", *extra, timeout=90.0,
        )  # fmt: skip

    with ThreadPoolExecutor(3) as pool:
        starts = [pool.submit(start, rank) for rank in range(3)]
        outcomes = [f.exception(timeout=120) for f in starts]
    started = [f.result() for f, error in zip(starts, outcomes, strict=True) if error is None]
    try:
        assert len(started) == 3, f"a replica did not start: {outcomes}"
        yield [_Rank(rank, process) for rank, process in enumerate(started)]
    finally:
        for process in started:
            process.stop()


@pytest.fixture(autouse=True)
def pages_return(ranks: list[_Rank]) -> Iterator[None]:
    assert [r.free_blocks() for r in ranks] == [NUM_BLOCKS] * 3
    yield
    eventually(lambda: [r.free_blocks() for r in ranks] == [NUM_BLOCKS] * 3)


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def _prefill(replica: _Rank, batch: pb.Batch) -> pb.PrefillV2Response:
    return replica.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=DEADLINE)


def _decode_to_end(replica: _Rank, cached: pb.CachedBatch, tokens: dict[int, list[int]]) -> None:
    """DecodeV2 until every request finished (finished ones filtered out), appending to `tokens`.

    A migrated batch holds the prompts' KV only: the first call appends the prefill's tokens.
    """
    batch: pb.CachedBatch | None = cached
    appended = [pb.Tokens(ids=[tokens[r][0] for r in cached.request_ids])]
    while batch is not None:
        request = pb.DecodeV2Request(batches=[batch], last_iter_tokens=appended)
        resp = replica.stub.DecodeV2(request, timeout=DEADLINE)
        appended = []
        done = [g.request_id for g in resp.generations if g.HasField("generated_text")]
        for g in resp.generations:
            tokens[g.request_id].extend(g.tokens.ids)
        batch = resp.batch if resp.HasField("batch") else None
        if batch is not None and done:
            keep = [r for r in batch.request_ids if r not in done]
            request = pb.FilterBatchRequest(batch_id=batch.id, request_ids=keep)
            filtered = replica.stub.FilterBatch(request, timeout=DEADLINE)
            batch = filtered.batch if keep else None


def test_migration_between_front_processes_decodes_like_transformers(
    ranks: list[_Rank], tiny_llama: Path
) -> None:
    p, d = ranks[FRONT[0]], ranks[FRONT[1]]
    prompts, max_new = random_prompts(256, [37, 5, 20], seed=11), [6, 3, 5]
    batch = make_batch(10, prompts, max_new)
    first = _prefill(p, batch)
    tokens = {g.request_id: list(g.tokens.ids) for g in first.generations}
    send = pb.MigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
    receive = pb.ImmigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(p.stub.Migrate, send, timeout=DEADLINE)
        received = pool.submit(d.stub.Immigrate, receive, timeout=DEADLINE)
        moved = received.result(DEADLINE).batch
        assert sent.result(DEADLINE).batch.id == moved.id == 10
    assert p.stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_cached_batches == 0
    _decode_to_end(d, moved, tokens)
    assert [tokens[i] for i in range(len(prompts))] == reference(tiny_llama, prompts, max_new)


def _refusals(replica: _Rank) -> list[tuple[grpc.StatusCode, str]]:
    """Forwarded calls the servicer refuses, as (code, details) from `replica`."""
    batch = make_batch(40, random_prompts(256, [9, 3]), [4, 4])
    _prefill(replica, batch)
    try:
        peer = FRONT[0]
        again = pb.ImmigrateRequest(batch=batch, src=[peer], dst=[replica.rank])
        two_sources = pb.ImmigrateRequest(batch=batch, src=[peer, peer], dst=[replica.rank])
        outside = pb.LoadParamsRequest(load_case=pb.LOAD_FROM_DISK, model_name="x", model_path="/etc")
        no_peer = pb.PrefillV2Request(batch=batch, forward_case=pb.MIGRATE)
        return [
            _status(lambda: replica.stub.Immigrate(again, timeout=DEADLINE)),
            _status(lambda: replica.stub.Immigrate(two_sources, timeout=DEADLINE)),
            _status(lambda: replica.stub.LoadParams(outside, timeout=DEADLINE)),
            _status(lambda: replica.stub.PrefillV2(no_peer, timeout=DEADLINE)),
        ]
    finally:
        replica.stub.ClearCache(pb.ClearCacheRequest(), timeout=DEADLINE)


def test_forwarded_statuses_equal_the_single_process_servers(ranks: list[_Rank]) -> None:
    front, single = _refusals(ranks[FRONT[1]]), _refusals(ranks[SINGLE])
    assert [code for code, _ in front] == [
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert front == single


def test_an_immigrate_nobody_sends_to_ends_at_its_deadline_or_when_cancelled(ranks: list[_Rank]) -> None:
    p, d = ranks[FRONT[0]], ranks[FRONT[1]]
    batch = make_batch(70, random_prompts(256, [30]), [4])
    request = pb.ImmigrateRequest(batch=batch, src=[p.rank], dst=[d.rank])
    start = time.monotonic()
    code, _ = _status(lambda: d.stub.Immigrate(request, timeout=1.0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 3.0
    eventually(lambda: d.free_blocks() == NUM_BLOCKS, timeout=5.0)  # far sooner than --transfer-timeout

    call = d.stub.Immigrate.future(request, timeout=DEADLINE)
    eventually(lambda: d.free_blocks() < NUM_BLOCKS)  # admitted: its pages are allocated, it waits
    call.cancel()
    eventually(lambda: d.free_blocks() == NUM_BLOCKS, timeout=5.0)  # the servicer's end callback ran
