"""The descriptor-driven strategies can set every field of every request of both services."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import generate_pb2 as pb
from protos import router_pb2 as rpb
from tests.helpers.proto_strategies import every_field, fields_set, rpc_requests

SERVICES = {
    "generate.v2": pb.DESCRIPTOR.services_by_name["TextGenerationService"],
    "router.v1": rpb.DESCRIPTOR.services_by_name["RouterAdmin"],
}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_field_of_every_request_is_drawn(name: str) -> None:
    service: ServiceDescriptor = SERVICES[name]
    strategies = rpc_requests(service)
    wanted: set[str] = set()
    for method in service.methods:
        every_field(method.input_type, wanted)
    seen: set[str] = set()
    request = st.sampled_from(sorted(strategies)).flatmap(lambda m: strategies[m])

    @settings(max_examples=1500, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request)
    def draw(msg: Message) -> None:
        fields_set(msg, seen)

    draw()
    assert wanted - seen == set()
