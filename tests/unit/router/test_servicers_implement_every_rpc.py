"""The only `raise NotImplementedError` lines in the tree are grpcio-tools' generated servicer base
classes (`protos/*_pb2_grpc.py`, kept byte-identical to the generator by `make proto-check`). Every
RPC of the router's admin service is overridden, so no call ever reaches one of them (the replica
serves its service from a route table instead: tests/unit/server/test_server_schema.py)."""

from __future__ import annotations

import inspect

import pytest

from protos import router_pb2_grpc
from router.admin import AdminService


@pytest.mark.parametrize(
    ("base", "implementation"),
    [
        (router_pb2_grpc.RouterAdminServicer, AdminService),
    ],
)
def test_every_generated_rpc_is_overridden(base: type, implementation: type) -> None:
    rpcs = [name for name, _ in inspect.getmembers(base, inspect.isfunction) if not name.startswith("_")]
    assert rpcs, "the generated base class lists no RPC"
    assert [name for name in rpcs if getattr(implementation, name) is getattr(base, name)] == []
    assert issubclass(implementation, base)
