"""Hypothesis against live gRPC servers, black box: a replica subprocess on a tiny model
(`generate.v2.TextGenerationService`) and a router subprocess over it (`router.v1.RouterAdmin`).

Requests are drawn from the protobuf descriptors (tests/helpers/proto_strategies.py: every field of
every request message), first one call of each RPC, then random sequences of calls (batches a
Prefill cached are what a later Decode, FilterBatch or Migrate may name). Properties:
- every answer is OK or a status of docs/replica-rpc.md's error codes, never UNKNOWN, INTERNAL, UNIMPLEMENTED;
- the processes stay up;
- page accounting is exact afterwards: once the cache is cleared, Info.num_blocks_free is back to
  its start value;
- no thread or file descriptor leaks: more fuzzing after a first round grows neither.

Short here; `make fuzz` sets PDCLUSTER_FUZZ_EXAMPLES for a long run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from protos import router_pb2 as rpb
from protos import router_pb2_grpc as rpb_grpc
from tests.helpers.eventually import eventually
from tests.helpers.fuzz import fuzz_examples, fuzz_seed
from tests.helpers.processes import alive, descendants
from tests.helpers.proto_strategies import Hints, rpc_requests

ROOT = Path(__file__).resolve().parents[3]
DOCUMENTED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED,
})
TRANSFER_TIMEOUT_S = 1.0
CALL_DEADLINE_S = 2.0
NUM_BLOCKS = 64
TOKEN = "fuzz-token"
VOCAB = 512

small_ids = st.integers(0, 3)
ranks = st.integers(-1, 2)
REPLICA_HINTS: Hints = {
    "id": small_ids, "batch_id": small_ids, "request_id": small_ids,
    "request_ids": small_ids, "input_tokens": st.integers(0, VOCAB + 1),
    "max_new_tokens": st.integers(0, 6), "max_tokens": st.integers(0, 64), "size": st.integers(0, 4),
    "src": ranks, "dst": ranks, "pipe_peer": ranks, "src_ranks": ranks, "dst_ranks": ranks, "rank": ranks,
    "num_layer": st.integers(0, 3), "zag_layers": st.integers(0, 3), "zag_seq_num": st.integers(0, 3),
    "model_path": st.sampled_from(["", "..", "/etc", "missing", "tiny"]),
    "temperature": st.floats(0.1, 2.0), "top_p": st.floats(0.1, 1.0), "typical_p": st.floats(0.1, 1.0),
    "repetition_penalty": st.floats(0.5, 2.0), "truncate": st.integers(0, 16),
    "top_n_tokens": st.integers(0, 5),
    "forward_case": st.sampled_from([0, 1, 2, 4, 8, 12, 3]),
    # well-formed sampling and stopping half of the time, so that prefills and decodes succeed
    "Request.parameters": st.builds(
        pb.NextTokenChooserParameters, temperature=st.floats(0.1, 2.0), do_sample=st.booleans(),
        seed=st.integers(0, 2**64 - 1), repetition_penalty=st.floats(0.5, 2.0), top_p=st.just(1.0),
        typical_p=st.just(1.0)),
    "Request.stopping_parameters": st.builds(
        pb.StoppingCriteriaParameters, max_new_tokens=st.integers(1, 6),
        stop_sequences=st.lists(st.text(max_size=3), max_size=2), ignore_eos_token=st.booleans()),
    "Request.inputs": st.just(""),
}
REPLICA_HINTS = {**REPLICA_HINTS, "Batch.requests": st.builds(
    pb.Request, id=st.integers(0, 15),
    input_tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    parameters=REPLICA_HINTS["Request.parameters"],
    stopping_parameters=REPLICA_HINTS["Request.stopping_parameters"])}


@dataclass
class Live:
    """A server under fuzz: how to call it and what it must not leak."""

    channel: grpc.Channel
    pids: Callable[[], list[int]]
    codes: dict[str, set[grpc.StatusCode]] = field(default_factory=dict)
    slowest: dict[str, float] = field(default_factory=dict)
    calls: int = 0

    def call(self, service: str, method: str, request: Message, metadata: tuple[tuple[str, str], ...] = ()
             ) -> tuple[grpc.StatusCode, Any]:
        """One unary call; the status and the answer (None unless OK)."""
        callable_ = self.channel.unary_unary(
            f"/{service}/{method}", request_serializer=type(request).SerializeToString,
            response_deserializer=lambda data: data)
        began = time.monotonic()
        try:
            answer = callable_(request, timeout=CALL_DEADLINE_S, metadata=metadata)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code, answer = err.code(), err.details()
        took = time.monotonic() - began
        self.slowest[method] = max(self.slowest.get(method, 0.0), took)
        self.calls += 1
        self.codes.setdefault(method, set()).add(code)
        assert code in DOCUMENTED, f"{service}/{method}({request}) answered {code}: {answer}"
        for pid in self.pids():
            assert alive(pid), f"process {pid} died after {method}({request})"
        return code, answer

    def resources(self) -> tuple[int, int]:
        """(threads, open file descriptors) over the server's processes."""
        threads = fds = 0
        for pid in self.pids():
            threads += len(list(Path(f"/proc/{pid}/task").iterdir()))
            fds += len(list(Path(f"/proc/{pid}/fd").iterdir()))
        return threads, fds


def replica_stub(live: Live) -> pb_grpc.TextGenerationServiceStub:
    return pb_grpc.TextGenerationServiceStub(live.channel)


def free_blocks(live: Live) -> int:
    return int(replica_stub(live).Info(pb.InfoRequest(), timeout=30).num_blocks_free)


def settle_pages(live: Live, start: int, timeout: float = 30.0) -> int:
    """Clear every cached batch until Info says `start` pages are free (in-flight work may still end);
    the test fails naming the last count if they never are."""
    seen: list[int] = []

    def cleared() -> bool:
        replica_stub(live).ClearCache(pb.ClearCacheRequest(), timeout=30)
        seen.append(free_blocks(live))
        return seen[-1] == start

    eventually(cleared, timeout, interval=0.3, message=lambda: f"{start} pages free (last: {seen[-1]})")
    return seen[-1]


@pytest.fixture(scope="module")
def replica(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ReplicaProcess, Live]]:
    model = tiny_model_factory()
    log = tmp_path_factory.mktemp("fuzz") / "replica.log"
    proc = ReplicaProcess.start(model, "--num-blocks", str(NUM_BLOCKS), "--transfer-timeout",
                                str(TRANSFER_TIMEOUT_S), "--allow-set-status-ready", log=log)
    channel = grpc.insecure_channel(proc.address)
    pid = proc.process.pid
    try:
        yield proc, Live(channel, lambda: [pid, *descendants(pid)])
    finally:
        channel.close()
        proc.stop()


NO_METADATA: st.SearchStrategy[tuple[tuple[str, str], ...]] = st.just(())


def fuzz(live: Live, service: str, strategies: dict[str, st.SearchStrategy[Message]], examples: int,
         metadata: st.SearchStrategy[tuple[tuple[str, str], ...]] = NO_METADATA) -> None:
    """Random sequences of 1-6 calls of `service`, `examples` sequences per RPC on average."""
    call = st.sampled_from(sorted(strategies)).flatmap(lambda m: st.tuples(st.just(m), strategies[m]))

    @settings(max_examples=examples * len(strategies), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(calls=st.lists(call, min_size=1, max_size=6), meta=metadata)
    def sequences(calls: list[tuple[str, Message]], meta: tuple[tuple[str, str], ...]) -> None:
        for method, request in calls:
            live.call(service, method, request, meta)

    chosen = fuzz_seed()
    (seed(chosen)(sequences) if chosen is not None else sequences)()


def sweep(live: Live, service: str, strategies: dict[str, st.SearchStrategy[Message]],
          metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """Each RPC once with its empty request: every one is reached, whatever the draws."""
    module = pb if service.startswith("generate") else rpb
    methods = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]].methods_by_name
    for method in sorted(strategies):
        live.call(service, method, message_factory.GetMessageClass(methods[method].input_type)(), metadata)


def assert_no_leak(live: Live, before: tuple[int, int], slack: int = 4, timeout: float = 20.0) -> None:
    def within() -> tuple[int, int] | None:
        now = live.resources()
        return now if now[0] <= before[0] + slack and now[1] <= before[1] + slack else None

    eventually(within, timeout, interval=0.3,
               message=lambda: f"threads, fds back near {before} (now {live.resources()})")


def test_replica_rpcs_answer_documented_statuses_and_leak_nothing(
    replica: tuple[ReplicaProcess, Live],
) -> None:
    _, live = replica
    service = "generate.v2.TextGenerationService"
    strategies = rpc_requests(pb.DESCRIPTOR.services_by_name["TextGenerationService"], REPLICA_HINTS)
    start = settle_pages(live, free_blocks(live))
    sweep(live, service, strategies)
    fuzz(live, service, strategies, max(1, fuzz_examples(3) // 2))
    assert settle_pages(live, start) == start
    baseline = live.resources()
    fuzz(live, service, strategies, max(1, fuzz_examples(3) // 2))
    replica_stub(live).SetStatusReady(pb.SetStatusReadyRequest(), timeout=30)
    assert settle_pages(live, start) == start, "pages leaked"
    assert_no_leak(live, baseline)
    assert set(live.codes) == set(strategies)
    print(f"replica fuzz: {live.calls} calls of {len(live.codes)} RPCs, codes {summary(live)}")


def summary(live: Live) -> dict[str, list[str]]:
    return {m: sorted(c.name for c in codes) for m, codes in sorted(live.codes.items())}


@pytest.fixture(scope="module")
def router(replica: tuple[ReplicaProcess, Live], tiny_model_factory: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    model = tiny_model_factory()
    log = (tmp_path_factory.mktemp("fuzz-router") / "router.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster", "router", "--model", str(model),
         "--replica", replica[0].address, "--http-port", "0", "--admin-port", "0",
         "--admin-token", TOKEN, "--rpc-timeout", "5",
         "--transfer-timeout", "3", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pdcluster router ready:"), line
        admin = dict(p.split("=", 1) for p in line.split() if "=" in p)["admin"]
        channel = grpc.insecure_channel(admin)
        yield Live(channel, lambda: [proc.pid])
        channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def router_hints(replica_address: str) -> Hints:
    port = st.integers(0, 65535).map(str)
    loopback = st.one_of(
        st.just(replica_address), port.map(lambda p: f"127.0.0.1:{p}"), port.map(lambda p: f"[::1]:{p}"),
        st.sampled_from(["", "127.0.0.1", "127.0.0.1:x", ":", "127.0.0.1:99999"]),
    )  # never a host name: nothing may be looked up or reached off this machine
    ids = st.integers(0, 3)
    return {"address": loopback, "replica_id": ids, "replica_ids": ids, "source_ids": ids}


def test_router_admin_answers_documented_statuses(replica: tuple[ReplicaProcess, Live], router: Live) -> None:
    proc, replica_live = replica
    service = "router.v1.RouterAdmin"
    descriptor = rpb.DESCRIPTOR.services_by_name["RouterAdmin"]
    hints = router_hints(proc.address)
    strategies = {m: s for m, s in rpc_requests(descriptor, hints).items() if m != "RegisterReplica"}
    # RegisterReplica only with addresses from the hints (its free-text field would name hosts)
    strategies["RegisterReplica"] = st.builds(
        rpb.RegisterReplicaRequest, address=hints["address"], role=st.integers(-1, 11))
    tokens = st.sampled_from([(), (("x-admin-token", TOKEN),), (("x-admin-token", "wrong"),)])
    start = settle_pages(replica_live, free_blocks(replica_live))
    sweep(router, service, strategies, (("x-admin-token", TOKEN),))
    fuzz(router, service, strategies, fuzz_examples(3), tokens)
    baseline = router.resources()
    fuzz(router, service, strategies, max(1, fuzz_examples(3) // 2), tokens)
    rpb_grpc.RouterAdminStub(router.channel).ListReplicas(rpb.ListReplicasRequest(), timeout=30)
    assert_no_leak(router, baseline)
    replica_stub(replica_live).SetStatusReady(pb.SetStatusReadyRequest(), timeout=30)
    assert settle_pages(replica_live, start) == start, "pages leaked on the replica"
    assert set(router.codes) == set(strategies)
    print(f"router admin fuzz: {router.calls} calls of {len(router.codes)} RPCs, codes {summary(router)}")
