"""`serve(config)`: the `pdcluster replica` process.

Binds the port first (Health answers "loading" while the checkpoint loads), loads the model, then
prints exactly one line `pdcluster replica serving on HOST:PORT` on stdout (with the real port
when `--port 0`) and serves until SIGTERM or SIGINT, which shut it down cleanly (exit code 0).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.cluster import ReplicaCluster, build_cluster
from replica.config import ReplicaConfig
from replica.engine.factory import build_engine_and_params
from replica.engine.worker import EngineWorker
from replica.placement import CpuPlacement, PlacementError, allowed_cpus
from replica.registration import RouterRegistration
from replica.server.front_process import FrontProcess
from replica.server.interceptor import ErrorInterceptor
from replica.server.servicer import ReplicaServicer

log = logging.getLogger("replica")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
READY_PREFIX = "pdcluster replica serving on"
_MESSAGE_BYTES = 64 * 1024 * 1024


def _build_server(config: ReplicaConfig, address: str) -> tuple[grpc.Server, int]:
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="grpc"),
        interceptors=[ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
        ],
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port


def _install_signal_handlers(stop: threading.Event) -> None:
    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _register(config: ReplicaConfig, port: int) -> RouterRegistration | None:
    """Register with the router (in the background, retrying) when `--router` is given."""
    if not config.router:
        return None
    registration = RouterRegistration(
        config.router, f"{config.host}:{port}", config.role, config.router_token
    )
    registration.start()
    return registration


@dataclass
class _Services:
    """The running gRPC server and what it serves."""

    server: grpc.Server
    port: int
    worker: EngineWorker
    servicer: ReplicaServicer
    health: health.HealthServicer
    cluster: ReplicaCluster | None = None  # the fabric, once the model is loaded

    def set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=5.0).wait(10.0)
        if self.cluster is not None:
            self.cluster.close()
        self.worker.stop()


def _start_services(config: ReplicaConfig, internal: bool = False) -> _Services:
    """Bind, register the generate.v2, health and reflection services, start serving (not ready yet).

    `internal`: on 127.0.0.1:0, for the front process only (`serve` with `--grpc-frontend`), which
    forwards grpc.health.v1 to it (the service's own calls come over frames: hotpath.py, service_channel.py).
    """
    server, port = _build_server(config, "127.0.0.1:0" if internal else f"{config.host}:{config.port}")
    worker = EngineWorker()
    servicer = ReplicaServicer(config, worker)
    servicer.address = f"{config.host}:{port}"
    health_servicer = health.HealthServicer()
    pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.start()
    services = _Services(server, port, worker, servicer, health_servicer)
    services.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    return services


def load_and_connect(config: ReplicaConfig, services: _Services) -> None:
    """Load the model on the engine thread, create the fabric (buffers registered), start serving."""
    engine, params = services.worker.call(lambda: build_engine_and_params(config))
    services.cluster = build_cluster(config, services.port, engine)
    services.servicer.attach(engine, params, services.cluster)
    services.set_health(health_pb2.HealthCheckResponse.SERVING)


def launch(config: ReplicaConfig) -> _Services:
    """A serving replica in this process (what `serve` runs; in-process multi-replica tests use it)."""
    services = _start_services(config)
    try:
        load_and_connect(config, services)
    except BaseException:
        services.stop()
        raise
    return services


def serve(config: ReplicaConfig) -> int:
    """Run one replica until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        placement = _placement(config)
    except PlacementError as exc:
        log.error("%s", exc)
        return 2
    threads = placement.torch_threads(config.torch_threads) if placement else config.torch_threads
    if threads:
        import torch

        torch.set_num_threads(threads)
    if placement is not None:  # before any thread or the front process starts: they inherit it
        placement.apply_to_process()
        log.info("CPU placement: %s", placement.describe())
    stop, lost = threading.Event(), threading.Event()
    _install_signal_handlers(stop)
    services = _start_services(config, internal=config.grpc_frontend)
    if placement is not None:
        services.worker.call(placement.apply_to_engine_thread)
    front = _start_front(config, services, stop, lost) if config.grpc_frontend else None
    try:
        load_and_connect(config, services)
    except Exception:
        log.exception("cannot load the model from %s or start the fabric", config.model)
        _stop(services, front)
        return 1
    print(f"{READY_PREFIX} {config.host}:{services.port}", flush=True)
    registration = _register(config, services.port)
    stop.wait()
    if registration is not None:
        registration.stop()
    _stop(services, front)
    log.info("replica stopped")
    return 1 if lost.is_set() else 0


def _placement(config: ReplicaConfig) -> CpuPlacement | None:
    """The CPU placement `--engine-cpus` asks for (None without it)."""
    if not config.engine_cpus:
        return None
    return CpuPlacement.plan(config.engine_cpus, allowed_cpus(), config.torch_threads)


def _start_front(
    config: ReplicaConfig, services: _Services, stop: threading.Event, lost: threading.Event
) -> FrontProcess:
    """The gRPC front process on the public port; `services.port` becomes its port."""

    def on_lost() -> None:  # the front died: this replica can no longer be reached
        lost.set()
        stop.set()

    servicer = services.servicer
    try:
        front = FrontProcess.start(
            config, f"127.0.0.1:{services.port}", services.worker, lambda: servicer.engine, servicer, on_lost
        )
    except BaseException:
        services.stop()
        raise
    services.port = front.port
    servicer.address = f"{config.host}:{front.port}"
    return front


def _stop(services: _Services, front: FrontProcess | None) -> None:
    if front is not None:
        front.stop()  # first: no new calls reach the engine
    services.stop()
