"""`pdcluster replica --tp 2`: rank 0 serves gRPC and drives rank 1; Info says tp_size 2 and a
greedy request decodes transformers' tokens through Prefill and Decode; KV migration (which would
move rank 0's shard only) is refused with FAILED_PRECONDITION; stopping the replica ends its worker."""

from __future__ import annotations

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
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
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
    with pytest.raises(grpc.RpcError) as refused:
        stub.Migrate(pb.MigrateRequest(batch=batch(2, request(2, PROMPT, 1)), src=[0], dst=[1]), timeout=30)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "tensor-parallel replica (--tp 2)" in str(refused.value.details())


def test_tp2_replica_serves_transformers_tokens(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory(arch="qwen2", kv_heads=1, seed=21)
    port = free_ports(1)[0]
    argv = pdcluster_argv("replica", "--model", str(model), "--port", str(port), "--tp", "2",
                          "--num-blocks", "32", "--block-size", "4")
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            assert _wait_info(stub, process).tp_size == 2
            tokens = _greedy(stub)
            _check_migration_refused(stub)
        workers = descendants(process.pid)
        assert workers, "rank 0 started no worker process"
    finally:
        process.terminate()
        process.wait(timeout=60)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    assert tokens == [int(t) for t in out[0, len(PROMPT):]]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), "a worker outlived its leader"
