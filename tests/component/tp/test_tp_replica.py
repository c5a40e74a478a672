"""`pdcluster replica --tp 2`: rank 0 serves gRPC and drives rank 1; Info says tp_size 2 and a
greedy request decodes transformers' tokens through Prefill and Decode; without its ranks in a
rank table a migration (or migrating prefill) is refused with FAILED_PRECONDITION; once the worker
is killed, calls fail UNAVAILABLE and rank 0 leaves by itself (exit 1, a log line naming the rank),
so that a supervisor restarts the whole group (`tests/cluster/launch/test_up_tp_restart.py`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from pdcluster.cluster.processes import pdcluster_argv
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.errors import CAUSE_KEY
from tests.helpers.processes import alive, descendants
from tests.helpers.replica_script import batch, request
from transfer.ports import free_ports

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
PROMPT = [5, 17, 42, 99, 7, 250, 3]
STEPS = 6


def _wait_info(stub: pb_grpc.TextGenerationServiceStub, process: subprocess.Popen[str]) -> pb.InfoResponse:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the tp replica exited with {process.returncode}"
        try:
            return stub.Info(pb.InfoRequest(), timeout=5)
        except grpc.RpcError:
            time.sleep(0.5)
    raise AssertionError("the tp replica did not answer Info within 120 s")


def _greedy(stub: pb_grpc.TextGenerationServiceStub) -> list[int]:
    answer = stub.PrefillV2(pb.PrefillV2Request(batch=batch(1, request(1, PROMPT, STEPS))), timeout=60)
    tokens = list(answer.generations[0].tokens.ids)
    while answer.HasField("batch"):
        answer = stub.Decode(pb.DecodeRequest(batches=[answer.batch]), timeout=60)
        tokens += list(answer.generations[0].tokens.ids)
    return tokens


def _check_migration_refused(stub: pb_grpc.TextGenerationServiceStub) -> None:
    # a replica whose group's ranks are not in a rank table (no --cluster) has no per-rank endpoints
    calls = [
        lambda: stub.PrefillV2(pb.PrefillV2Request(batch=batch(2, request(2, PROMPT, 1)), pipe_peer=[2],
                                                   forward_case=pb.MIGRATE_PROGRESSIVE), timeout=30),
        lambda: stub.Migrate(pb.MigrateRequest(batch=batch(2, request(2, PROMPT, 1)), src=[0], dst=[2]),
                             timeout=30),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "every rank of its group in the rank table" in str(refused.value.details())


def _tp_workers(pid: int) -> list[int]:
    """The `replica.tp.worker` processes under `pid` (the replica may also run a gRPC front process)."""
    found = []
    for child in descendants(pid):
        try:
            if b"replica.tp.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _check_broken(stub: pb_grpc.TextGenerationServiceStub) -> None:
    """Every call fails UNAVAILABLE: a step's own TpGroupFailed (no peer cause), or the server leaving."""
    with pytest.raises(grpc.RpcError) as failed:
        stub.PrefillV2(pb.PrefillV2Request(batch=batch(3, request(3, PROMPT, 2))), timeout=60)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    assert not any(key == CAUSE_KEY for key, _ in failed.value.trailing_metadata() or ())
    with pytest.raises(grpc.RpcError) as health:
        stub.Health(pb.HealthRequest(), timeout=30)
    # UNAVAILABLE from the broken group, or CANCELLED by a server already shutting down (both mean
    # "replica unavailable" to the router: router/client.py)
    assert health.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_tp2_replica_serves_transformers_tokens(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory(arch="qwen2", kv_heads=1, seed=21)
    port = free_ports(1)[0]
    argv = pdcluster_argv("replica", "--model", str(model), "--port", str(port), "--tp", "2",
                          "--num-blocks", "32", "--block-size", "4", "--tp-timeout", "10")
    log = tmp_path / "replica.log"  # a file, not a pipe: nothing reads it while the replica runs
    with log.open("w") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            assert _wait_info(stub, process).tp_size == 2
            tokens = _greedy(stub)
            _check_migration_refused(stub)
            workers = _tp_workers(process.pid)
            assert len(workers) == 1, "rank 0 did not start exactly one worker process"
            os.kill(workers[0], signal.SIGKILL)
            _check_broken(stub)
            assert process.wait(timeout=60) == 1, "rank 0 of a broken group did not leave by itself"
    finally:
        process.terminate()
        process.wait(timeout=60)
    # the cause: the worker's exit (seen by rank 0's watch) or the step's collective, whichever came first
    assert "): rank 0 exits 1 so that its supervisor restarts the whole group" in log.read_text()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    assert tokens == [int(t) for t in out[0, len(PROMPT):]]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), "a worker outlived its leader"
