"""A migration whose peer process dies mid-transfer: the survivor fails fast and frees its pages.

Three `pdcluster replica` subprocesses share a rank table in which every rank is its own node behind
an emulated 4 Mbit/s NIC, so the ~1.6 MB of KV of the batch takes seconds on the wire; the kill
lands once the sender has taken the batch out of its store (the transfer has started), well before
the last byte could have arrived.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.eventually import eventually
from tests.helpers.migration_cluster import code_and_cause, make_batch, random_prompts, write_rank_table

NUM_BLOCKS = 256
TRANSFER_TIMEOUT = 20.0
DEADLINE = 30.0
LINK_GBPS = 0.004  # 500 kB/s: 1.6 MB of KV takes ~3 s


@pytest.fixture(scope="module")
def replicas(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProcess]]:
    """Three replicas: rank 1 dies in one test, rank 2 in the other, rank 0 survives both."""
    table = write_rank_table(tmp_path_factory.mktemp("kills") / "ranks.json", 3, link_gbps=LINK_GBPS)
    with ThreadPoolExecutor(3) as pool:
        starts = [pool.submit(_start, tiny_llama, table, rank) for rank in range(3)]
        outcomes = [f.exception(timeout=120) for f in starts]
    started = [f.result() for f, error in zip(starts, outcomes, strict=True) if error is None]
    try:
        assert len(started) == 3, f"a replica did not start: {outcomes}"
        yield started
    finally:
        for replica in started:
            replica.stop()


def _start(model: Path, table: Path, rank: int) -> ReplicaProcess:
    return ReplicaProcess.start(
        model,
        "--rank",
        str(rank),
        "--cluster",
        str(table),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--transfer-timeout",
        str(TRANSFER_TIMEOUT),
        "--torch-threads",
        "1",
        timeout=90.0,
    )


def _stub(replica: ReplicaProcess) -> pb_grpc.TextGenerationServiceStub:
    return pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(replica.address))


def _info(replica: ReplicaProcess) -> pb.InfoResponse:
    return _stub(replica).Info(pb.InfoRequest(), timeout=DEADLINE)


def _big_batch(seed: int) -> pb.Batch:
    """200 pages x 2 layers x 4 KiB of prompts no replica has seen (a replica holding them in its
    prefix cache would receive almost nothing: a migration moves only the pages it lacks)."""
    return make_batch(7, random_prompts(256, [400] * 8, seed=seed), [8] * 8)


def _start_migration(
    pool: ThreadPoolExecutor, p: ReplicaProcess, d: ReplicaProcess, ranks: tuple[int, int]
) -> tuple[Future[object], Future[object]]:
    batch = _big_batch(seed=ranks[0] + 10)
    _stub(p).PrefillV2(pb.PrefillV2Request(batch=batch), timeout=DEADLINE)
    send = pb.MigrateRequest(batch=batch, src=[ranks[0]], dst=[ranks[1]])
    receive = pb.ImmigrateRequest(batch=batch, src=[ranks[0]], dst=[ranks[1]])
    sent = pool.submit(_stub(p).Migrate, send, timeout=DEADLINE)
    received = pool.submit(_stub(d).Immigrate, receive, timeout=DEADLINE)
    eventually(lambda: _info(p).num_cached_batches == 0, 20)  # the sender took the batch: bytes are moving
    time.sleep(0.3)  # the scenario: the kill lands while the (paced) bytes move
    assert not sent.done() and not received.done(), "the transfer finished before the kill"
    return sent, received


def test_receiver_killed_mid_migration(replicas: list[ReplicaProcess]) -> None:
    p, d = replicas[0], replicas[1]
    with ThreadPoolExecutor(2) as pool:
        sent, received = _start_migration(pool, p, d, (0, 1))
        killed_at = time.monotonic()
        d.process.kill()
        code, cause = code_and_cause(lambda: sent.result(DEADLINE))
        assert time.monotonic() - killed_at < TRANSFER_TIMEOUT
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert cause == "peer"  # the sender is alive: its peer failed (a router must not mark it dead)
        # the receiver's process is gone: no replica answered, so nothing names a cause
        assert code_and_cause(lambda: received.result(DEADLINE)) == (grpc.StatusCode.UNAVAILABLE, None)
    info = _info(p)
    assert (info.num_blocks_free, info.num_cached_batches) == (NUM_BLOCKS, 0)


def test_sender_killed_mid_migration(replicas: list[ReplicaProcess]) -> None:
    p, d = replicas[2], replicas[0]
    with ThreadPoolExecutor(2) as pool:
        sent, received = _start_migration(pool, p, d, (2, 0))
        assert _info(d).num_blocks_free < NUM_BLOCKS  # the receiver allocated its pages
        killed_at = time.monotonic()
        p.process.kill()
        code, cause = code_and_cause(lambda: received.result(DEADLINE))
        assert time.monotonic() - killed_at < TRANSFER_TIMEOUT
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert cause == "peer"
        code_and_cause(lambda: sent.result(DEADLINE))
    info = _info(d)
    assert (info.num_blocks_free, info.num_cached_batches) == (NUM_BLOCKS, 0)
