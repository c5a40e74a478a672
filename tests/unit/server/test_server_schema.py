"""The schema and the tables of the one RPC path: every RPC of the service has a route in the
edge's table, every call a handler in the core's table (in the lane its message names), the case
numbers are the proto's, and every call survives the front process's frames."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from protos import generate_pb2 as pb
from replica.config import ReplicaConfig
from replica.engine.types import (
    BatchId,
    BatchSpec,
    DecodeInput,
    RequestId,
    RequestSpec,
    SamplingParams,
    WarmupSpec,
)
from replica.engine.worker import EngineWorker
from replica.server import messages as m
from replica.server.core import ReplicaCore
from replica.server.frames import Request, ToReplica
from replica.server.rpcs import RPCS, SERVICE


def test_every_rpc_of_the_service_has_one_route() -> None:
    methods = {method.name for method in pb.DESCRIPTOR.services_by_name["TextGenerationService"].methods}
    assert set(RPCS) == methods
    assert SERVICE == "generate.v2.TextGenerationService"
    for name, rpc in RPCS.items():
        descriptor = pb.DESCRIPTOR.services_by_name["TextGenerationService"].methods_by_name[name]
        assert rpc.request.DESCRIPTOR is descriptor.input_type, name


def test_every_call_has_one_handler_in_its_lane() -> None:
    worker = EngineWorker("schema")
    try:
        core = ReplicaCore(ReplicaConfig(model=Path("unused"), port=0), worker)
        engine_calls, service_calls = set(core._engine_calls), set(core._service_calls)
    finally:
        worker.stop()
    assert engine_calls | service_calls == set(m.CALLS) and not engine_calls & service_calls
    assert engine_calls == {kind for kind in m.CALLS if kind.lane is m.Lane.ENGINE}
    assert set(m.AnyCall.__args__) == set(m.CALLS)


def test_case_numbers_are_the_protos() -> None:
    assert {name: case.value for name, case in m.PrefillCase.__members__.items()} == dict(
        pb.PrefillCase.items()
    )
    assert [m.PartialCase.UNSPECIFIED, m.PartialCase.FIRST, m.PartialCase.SECOND] == [
        pb.PARTIAL_CASE_UNSPECIFIED, pb.PARTIAL_CASE_FIRST, pb.PARTIAL_CASE_SECOND,
    ]  # fmt: skip
    assert (m.LoadCase.HOST_MEM, m.LoadCase.DISK) == (pb.LOAD_FROM_HOST_MEM, pb.LOAD_FROM_DISK)
    oneof = pb.PipeParaInfo.DESCRIPTOR.oneofs_by_name["start_layer"]
    assert {s.value for s in m.PipeStart} == {f.name for f in oneof.fields}


_SPEC = BatchSpec(
    BatchId(3),
    (
        RequestSpec(
            RequestId(1), (1, 2, 3), sampling=SamplingParams(do_sample=True, seed=5, logit_bias=((4, 1.5),))
        ),
    ),
)


@pytest.mark.parametrize(
    "call",
    [
        m.Decode((DecodeInput(BatchId(3), (7,)), DecodeInput(BatchId(4)))),
        m.Prefill(_SPEC),
        m.Filter(BatchId(3), (RequestId(1),)),
        m.Clear(None),
        m.Warmup(WarmupSpec(max_total_tokens=64, batch=_SPEC)),
        m.MigratePartial(_SPEC, m.PartialCase.SECOND, 2, (0,), (1,)),
        m.PipelinedPrefill(_SPEC, 12, m.PipeStart.LAYER, 3, (2,)),
        m.Broadcast(m.BroadcastKind.TANZ, (0, 1), (2, 3, 4, 5)),
        m.LoadParams(m.LoadCase.DISK, "tiny", None),
    ],
    ids=lambda call: type(call).__name__,
)
def test_calls_survive_the_frames(call: m.Call) -> None:
    request = Request(7, 12.5, call)  # type: ignore[arg-type]
    back = msgspec.msgpack.Decoder(ToReplica).decode(msgspec.msgpack.encode(request))
    assert back == request and type(back.call) is type(call)
