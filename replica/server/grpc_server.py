"""The gRPC server of a replica, built the same way wherever it runs (replica or front process).

It serves `generate.v2.TextGenerationService` through the edge (`rpcs.Edge`), `grpc.health.v1`
(NOT_SERVING until the model is loaded: `set_serving`) and reflection, so grpcurl can list and
describe everything. Messages up to 64 MiB each way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from replica.server.rpcs import SERVICE, Edge

MESSAGE_BYTES = 64 * 1024 * 1024


class GrpcServer:
    """A started gRPC server serving one edge, its health and reflection."""

    def __init__(self, address: str, workers: int, edge: Edge) -> None:
        options = [
            ("grpc.max_send_message_length", MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MESSAGE_BYTES),
        ]
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"), options=options
        )
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises where older versions returned 0
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.health = health.HealthServicer()
        self.server.add_generic_rpc_handlers((edge.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.set_serving(False)
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 says, for the whole server and for the service."""
        states = health_pb2.HealthCheckResponse
        status = states.SERVING if serving else states.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        """Health says NOT_SERVING; calls in flight get `grace` seconds to finish."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=grace).wait(grace * 2)
