"""A migration into a replica whose sender restarted (same rank) since their last migration.

The receiver still held its acknowledgement connection to the sender's previous life (closed by the
peer's death, never written since). Its ack for the new migration went into that dead connection:
the write succeeded locally, the record was lost, and the new sender waited for it until its
transfer deadline (DEADLINE_EXCEEDED, found by `bench soak`: 2 of 10 restarts). The receiver now
drops a connection its peer closed before it uses the ack stream, as the sender does for the KV
stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.migration_cluster import make_batch, random_prompts, write_rank_table

TRANSFER_TIMEOUT = 10.0
CALL = 30.0


def _start(model: Path, table: Path, rank: int) -> ReplicaProcess:
    return ReplicaProcess.start(model, "--rank", str(rank), "--cluster", str(table), "--num-blocks", "64",
                                "--transfer-timeout", str(TRANSFER_TIMEOUT), "--torch-threads", "1",
                                timeout=120.0)


@pytest.fixture
def pair(tiny_llama: Path, tmp_path: Path) -> Iterator[tuple[Path, Path, list[ReplicaProcess]]]:
    table = write_rank_table(tmp_path / "ranks.json", 2)
    replicas = [_start(tiny_llama, table, 0), _start(tiny_llama, table, 1)]
    try:
        yield tiny_llama, table, replicas
    finally:
        for replica in replicas:
            replica.stop()


def _migrate(sender: ReplicaProcess, receiver: ReplicaProcess, batch_id: int) -> float:
    """Prefill a batch on rank 0 and migrate it to rank 1; the seconds the pair of calls took."""
    batch = make_batch(batch_id, random_prompts(256, [40, 40]), [4, 4])
    send = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(sender.address))
    receive = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(receiver.address))
    send.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=CALL)
    start = time.monotonic()
    immigrated = receive.Immigrate.future(pb.ImmigrateRequest(batch=batch, src=[0], dst=[1]), timeout=CALL)
    send.Migrate(pb.MigrateRequest(batch=batch, src=[0], dst=[1]), timeout=CALL)
    immigrated.result(timeout=CALL)
    receive.ClearCache(pb.ClearCacheRequest(id=batch_id), timeout=CALL)
    return time.monotonic() - start


@pytest.mark.timeout(300)
def test_migration_from_a_restarted_sender_is_acknowledged(
    pair: tuple[Path, Path, list[ReplicaProcess]]
) -> None:
    model, table, replicas = pair
    _migrate(replicas[0], replicas[1], 1)  # the receiver's ack connection to rank 0 is up
    replicas[0].process.kill()
    replicas[0].process.wait(30)
    time.sleep(0.5)  # the dead sender's FIN has reached the receiver
    replicas[0] = _start(model, table, 0)
    assert _migrate(replicas[0], replicas[1], 2) < TRANSFER_TIMEOUT / 2
    info = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(replicas[1].address)).Info(
        pb.InfoRequest(), timeout=CALL)
    assert info.num_blocks_free == info.num_blocks_total
