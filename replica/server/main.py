"""`serve(config)`: the `pdcluster replica` process.

Binds the port first (Health answers "loading" while the checkpoint loads), loads the model, then
prints exactly one line `pdcluster replica serving on HOST:PORT` on stdout (with the real port
when `--port 0`) and serves until SIGTERM or SIGINT, which shut it down cleanly (exit code 0). A
tensor-parallel replica whose group breaks (a rank died) stops the same way and exits 1, so that
`up` / `launch` supervision restarts the whole group.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

from replica.cluster import ReplicaCluster, build_cluster
from replica.config import EngineKind, ReplicaConfig
from replica.engine.backends import build_engine_and_params
from replica.engine.worker import EngineWorker
from replica.placement import CpuPlacement, PlacementError, allowed_cpus
from replica.server.core import ReplicaCore
from replica.server.front_process import FrontProcess
from replica.server.grpc_server import GrpcServer
from replica.server.local import LocalCore
from replica.server.registration import RouterRegistration
from replica.server.rpcs import Edge
from replica.server.security import TlsFiles, read_token
from transfer.errors import FabricUnavailable

log = logging.getLogger("replica")

READY_PREFIX = "pdcluster replica serving on"


class Placement(Protocol):
    """Where the gRPC edge runs: in this process (`GrpcServer` over `LocalCore`) or in the front
    process (`FrontProcess`, its edge over `RemoteCore`). The same edge and core either way."""

    port: int

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 says."""

    def stop(self) -> None:
        """No new calls; calls in flight finish."""


def _install_signal_handlers(stop: threading.Event) -> None:
    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


@dataclass(frozen=True)
class EdgeSecurity:
    """TLS files and cluster token of the replica's gRPC edge (from its config)."""

    tls: TlsFiles
    token: str

    @classmethod
    def of(cls, config: ReplicaConfig) -> EdgeSecurity:
        """From the flags; ValueError names a missing TLS file or a bad token (file)."""
        tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca, config.tls_client_ca)
        return cls(tls, read_token(config.cluster_token, config.cluster_token_file))


def _register(config: ReplicaConfig, port: int, tls: TlsFiles) -> RouterRegistration | None:
    """Register with the router (in the background, retrying) when `--router` is given."""
    if not config.router:
        return None
    registration = RouterRegistration(
        config.router, f"{config.host}:{port}", config.role, config.router_token,
        credentials=tls.channel_credentials(),
    )
    registration.start()
    return registration


@dataclass
class _Services:
    """The running replica: its core, engine thread, gRPC placement and (once loaded) fabric."""

    core: ReplicaCore
    worker: EngineWorker
    placement: Placement
    cluster: ReplicaCluster | None = None  # the fabric, once the model is loaded
    stopped: bool = False

    @property
    def port(self) -> int:
        """The public gRPC port."""
        return self.placement.port

    def stop(self) -> None:
        """Stop serving, close the fabric, end the engine thread (once; later calls do nothing)."""
        if self.stopped:
            return
        self.stopped = True
        self.placement.set_serving(False)
        self.placement.stop()  # first: no new calls reach the engine
        if self.cluster is not None:
            self.cluster.close()
        self.worker.stop()


def _start_services(
    config: ReplicaConfig, front: bool = False, on_lost: Callable[[], None] = lambda: None
) -> _Services:
    """The core and its engine thread, and the gRPC edge placed in this process or in the front
    process (`front`); serving, not ready yet (engine calls answer "still loading")."""
    security = EdgeSecurity.of(config)
    worker = EngineWorker()
    core = ReplicaCore(config, worker)
    try:
        if front:
            placement: Placement = FrontProcess.start(config, core, on_lost, security.tls, security.token)
        else:
            address = f"{config.host}:{config.port}"
            edge = Edge(LocalCore(core), config.engine_tag)
            placement = GrpcServer(address, config.grpc_workers, edge, security.tls, security.token)
    except BaseException:
        worker.stop()
        raise
    return _Services(core, worker, placement)


def load_and_connect(config: ReplicaConfig, services: _Services) -> None:
    """Load the model on the engine thread, create the fabric (buffers registered), start serving."""
    build = build_engine_and_params
    if config.tp > 1:  # a group of processes, one shard each (replica/tp/README.md)
        from replica.tp.factory import build_tp_engine as build
    engine, params = services.worker.call(lambda: build(config))
    services.cluster = build_cluster(config, services.port, engine, params.room)
    services.core.attach(engine, params, services.cluster)
    services.placement.set_serving(True)


def launch(config: ReplicaConfig) -> _Services:
    """A serving replica with its gRPC edge in this process (in-process multi-replica tests)."""
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
        security = EdgeSecurity.of(config)
    except (PlacementError, ValueError, OSError) as exc:  # OSError: an unreadable token file
        log.error("%s", exc)
        return 2
    threads = placement.torch_threads(config.torch_threads) if placement else config.torch_threads
    if threads and config.engine is EngineKind.TORCH:  # a simulated replica never imports torch
        import torch

        torch.set_num_threads(threads)
    if placement is not None:  # before any thread or the front process starts: they inherit it
        placement.apply_to_process()
        log.info("CPU placement: %s", placement.describe())
    stop, lost = threading.Event(), threading.Event()
    _install_signal_handlers(stop)

    def on_lost() -> None:  # the front died: this replica can no longer be reached
        lost.set()
        stop.set()

    services = _start_services(config, front=config.grpc_frontend, on_lost=on_lost)
    if placement is not None:
        services.worker.call(placement.apply_to_engine_thread)
    try:
        load_and_connect(config, services)
    except FabricUnavailable as exc:  # no device, NIC, library or store: one line says which
        log.error("%s", exc)
        services.stop()
        return 1
    except Exception:
        log.exception("cannot load the model from %s or start the fabric", config.model)
        services.stop()
        return 1
    broken = _leave_when_group_breaks(config, services, stop)
    # one write of the whole line: under a launch (`2>&1`) the tp workers' logs share this stream, and
    # with PYTHONUNBUFFERED print() writes a line and its newline apart, letting another line between
    sys.stdout.write(f"{READY_PREFIX} {config.host}:{services.port}\n")
    sys.stdout.flush()
    registration = _register(config, services.port, security.tls)
    stop.wait()
    if registration is not None:
        registration.stop()
    if broken:  # the step in flight fails with TpGroupFailed (at the latest by --tp-timeout): answer it
        _drain(services, config.tp_timeout + 5)
    services.stop()
    if broken:
        log.error("tensor-parallel group broken (%s): rank 0 exits 1 so that its supervisor restarts "
                  "the whole group", broken[0])
    log.info("replica stopped")
    return 1 if lost.is_set() or broken else 0


def _drain(services: _Services, timeout: float) -> None:
    """Wait (up to `timeout`) for the engine thread to finish the item it runs, so that its caller
    gets the item's own answer before the connections close."""
    try:
        services.worker.call(lambda: None, timeout)
    except Exception as exc:  # a hung step: stop anyway
        log.warning("the engine thread did not finish its step within %.0f s: %s", timeout, exc)


def _leave_when_group_breaks(config: ReplicaConfig, services: _Services, stop: threading.Event) -> list[str]:
    """Under `--tp N`: once the group breaks, end `serve`'s wait, which answers the step in flight
    (`_drain`: UNAVAILABLE), stops serving and exits 1; the returned list then holds why."""
    broken: list[str] = []
    engine = services.core.shared.engine
    if config.tp > 1 and engine is not None:
        from replica.tp.factory import when_group_broken  # a one-rank replica never imports replica.tp

        def leave(reason: str) -> None:
            if stop.is_set():  # stopping already (a signal): a worker ending now is no failure
                return
            log.error("tensor-parallel group broken: %s; answering calls in flight, then exiting", reason)
            broken.append(reason)
            stop.set()

        when_group_broken(engine, leave)
    return broken


def _placement(config: ReplicaConfig) -> CpuPlacement | None:
    """The CPU placement `--engine-cpus` asks for (None without it)."""
    if not config.engine_cpus:
        return None
    return CpuPlacement.plan(config.engine_cpus, allowed_cpus(), config.torch_threads)
