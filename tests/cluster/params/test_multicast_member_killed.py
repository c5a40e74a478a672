"""A chain member killed mid-multicast: every other member's WaitRdmaDone fails clearly within the
deadline; a retried multicast (the member restarted) succeeds and the tail generates like transformers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.eventually import eventually
from tests.helpers.weights_cluster import generate, prompts_for, reference, write_rank_table

TRANSFER_TIMEOUT = 15.0
CALL = 60.0
MODEL = {"arch": "llama", "layers": 4, "hidden": 256, "intermediate": 1024, "vocab": 4096}  # ~24 MB
LINK_GBPS = 0.08  # ~10 MB/s per sender: a multicast takes seconds, long enough to kill a member


def _start(model: Path, table: Path, rank: int) -> ReplicaProcess:
    args = ["--cluster", str(table), "--rank", str(rank), "--num-blocks", "32", "--block-size", "8"]
    args += ["--transfer-timeout", str(TRANSFER_TIMEOUT)] + (["--inactive"] if rank else [])
    return ReplicaProcess.start(model, *args, timeout=120.0)


def _stub(replica: ReplicaProcess) -> pb_grpc.TextGenerationServiceStub:
    return pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(replica.address))


def _start_all(model: Path, table: Path, n: int) -> list[ReplicaProcess]:
    started: dict[int, ReplicaProcess] = {}
    threads = [
        threading.Thread(target=lambda r=r: started.update({r: _start(model, table, r)})) for r in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    if len(started) != n:
        for replica in started.values():
            replica.stop()
        raise RuntimeError("not every replica started")
    return [started[r] for r in range(n)]


def _warnings(replicas: list[ReplicaProcess]) -> list[str]:
    return [line for r in replicas for line in r.stderr_lines if "WARNING" in line]


def _broadcast(stubs: list[pb_grpc.TextGenerationServiceStub]) -> None:
    request = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[1, 2, 3])  # chain 0 → 1 → 2 → 3
    for stub in stubs:
        stub.RdmaBroadcast(request, timeout=CALL)


@pytest.mark.timeout(280)
def test_chain_member_killed_then_retry(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model_factory(**MODEL)
    prompts = prompts_for(4096, count=2)
    want = reference(model, prompts, 4)
    table = write_rank_table(tmp_path / "ranks.json", 4, LINK_GBPS)
    replicas = _start_all(model, table, 4)
    try:
        stubs = [_stub(r) for r in replicas]
        _broadcast(stubs)
        eventually(lambda: stubs[1].Info(pb.InfoRequest(), timeout=CALL).num_layers_loaded >= 1, 60,
                   interval=0.05, message="a layer landed on rank 1")
        replicas[2].process.kill()  # mid-multicast: rank 1 forwards to it, rank 3 receives from it
        replicas[2].process.wait(10)

        for rank in (0, 1, 3):
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                stubs[rank].WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL)
            assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert time.monotonic() - start < TRANSFER_TIMEOUT + 10, f"rank {rank} failed too late"
        assert stubs[3].Health(pb.HealthRequest(), timeout=CALL).state != "serving"

        replicas[2] = _start(model, table, 2)  # the member comes back (inactive) and the router retries
        stubs[2] = _stub(replicas[2])
        _broadcast(stubs)
        errors = []
        for stub in stubs:
            try:
                stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL)
            except grpc.RpcError as exc:
                errors.append(exc.details())
        assert not errors, (errors, _warnings(replicas))
        for stub in stubs[1:]:
            assert stub.Health(pb.HealthRequest(), timeout=CALL).state == "serving"
        assert generate(stubs[3], 1, prompts, 4) == want
        assert stubs[3].Info(pb.InfoRequest(), timeout=CALL).num_blocks_free == 32
    finally:
        for replica in replicas:
            replica.stop()
