"""The gRPC edge's conversions: proto zeros mean "unset", lists are checked, outputs round-trip."""

from __future__ import annotations

import math

import grpc
import pytest

from protos import generate_pb2 as pb
from replica.engine.types import (
    BatchId,
    CachedBatchInfo,
    FinishReason,
    GeneratedText,
    Generation,
    RequestId,
    TokenList,
)
from replica.errors import InvalidArgument, Status
from replica.server import convert
from replica.server.interceptor import CODES


def test_proto_zeros_become_neutral_values() -> None:
    spec = convert.request_from_pb(
        pb.Request(id=3, input_tokens=[1, 2], parameters=pb.NextTokenChooserParameters())
    )
    s = spec.sampling
    assert (s.temperature, s.top_p, s.typical_p, s.repetition_penalty, s.seed) == (1.0, 1.0, 1.0, 1.0, 0)
    assert spec.truncate is None and spec.input_tokens == (1, 2)
    truncated = convert.request_from_pb(pb.Request(id=1, truncate=5))
    assert truncated.truncate == 5


def test_bad_values_pass_through_for_validation_and_penalties_keep_presence() -> None:
    params = pb.NextTokenChooserParameters(temperature=-1.0, top_p=float("nan"), frequency_penalty=0.5)
    s = convert.sampling_from_pb(params)
    assert (
        s.temperature == -1.0
        and math.isnan(s.top_p)
        and s.frequency_penalty == 0.5
        and s.presence_penalty == 0
    )


def test_unset_seed_is_drawn_only_when_sampling() -> None:
    drawn = {convert.sampling_from_pb(pb.NextTokenChooserParameters(do_sample=True)).seed for _ in range(4)}
    assert len(drawn) > 1
    assert convert.sampling_from_pb(pb.NextTokenChooserParameters(do_sample=True, seed=7)).seed == 7


def test_last_iter_tokens_one_entry_per_batch() -> None:
    batches = [pb.CachedBatch(id=1), pb.CachedBatch(id=2)]
    inputs = convert.decode_inputs_from_pb(batches, [pb.Tokens(ids=[5]), pb.Tokens()])
    assert [(i.batch_id, i.last_iter_tokens) for i in inputs] == [(1, (5,)), (2, ())]
    with pytest.raises(InvalidArgument):
        convert.decode_inputs_from_pb(batches, [pb.Tokens(ids=[5])])


def test_generation_and_batch_to_pb() -> None:
    gen = Generation(
        request_id=RequestId(4),
        tokens=TokenList((9,), (-0.5,), ("x",), (False,)),
        generated_text=GeneratedText("hi x", 2, FinishReason.STOP_SEQUENCE, seed=11),
        top_tokens=(TokenList((9, 8), (-0.5, -1.0), ("x", "y"), (False, True)),),
    )
    msg = convert.generation_to_pb(gen)
    assert (
        msg.generated_text.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and msg.generated_text.seed == 11
    )
    assert list(msg.top_tokens[0].is_special) == [False, True] and not msg.HasField("prefill_tokens")
    cached = convert.cached_batch_to_pb(CachedBatchInfo(BatchId(2), (RequestId(4), RequestId(5)), 64))
    assert (cached.id, list(cached.request_ids), cached.size, cached.max_tokens) == (2, [4, 5], 2, 64)


def test_every_status_has_a_grpc_code() -> None:
    assert CODES[Status.RESOURCE_EXHAUSTED] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert set(CODES) == set(Status)
