"""`FrontProcess`: starts the gRPC front process (`frontend.py`) and wires its two socket pairs.

```
 serve(): internal gRPC server on 127.0.0.1:0 (health) ── FrontProcess.start ──► child binds --host:--port
          ◄── ("port", P) ── ready line names P
          hot calls: socket pair 1 ──► HotPath (read by the engine thread, hotpath.py)
          other unary calls of the service: socket pair 2 ──► ServiceChannel (reader thread + pool)
 stop:    close the hot socket ──► child stops its server (in-flight calls finish) and exits
          (killed after a grace period); then the service channel closes
```
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.worker import EngineWorker
from replica.server.hotpath import HotPath
from replica.server.service_channel import ServiceChannel
from replica.server.wire import FrameSocket

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]  # the folder holding the `replica` package
_START_TIMEOUT = 60.0  # seconds for the child to import grpc and bind


class FrontProcess:
    """The running front process and the replica's ends of its two socket pairs."""

    def __init__(
        self, proc: subprocess.Popen[bytes], hotpath: HotPath, services: ServiceChannel, port: int
    ) -> None:
        self.proc = proc
        self.hotpath = hotpath
        self.services = services
        self.port = port

    @classmethod
    def start(
        cls,
        config: ReplicaConfig,
        internal_address: str,
        worker: EngineWorker,
        engine: Callable[[], Engine | None],
        servicer: object,
        on_lost: Callable[[], None],
    ) -> FrontProcess:
        """Spawn the child, wait for its bound port, start serving its calls.

        `servicer` (the `ReplicaServicer` the internal server serves) answers the service channel.
        """
        mine, theirs = socket.socketpair()
        service_mine, service_theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "replica.server.frontend", "--fd", str(theirs.fileno()),
               "--service-fd", str(service_theirs.fileno()),
               "--host", config.host, "--port", str(config.port), "--backend", internal_address,
               "--workers", str(config.grpc_workers)]  # fmt: skip
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), service_theirs.fileno()),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)  # fmt: skip
        theirs.close()
        service_theirs.close()
        wire = FrameSocket(mine)
        mine.settimeout(_START_TIMEOUT)
        hello = wire.recv()
        mine.settimeout(None)
        if not (isinstance(hello, tuple) and hello[0] == "port" and hello[1]):
            proc.kill()
            proc.wait()
            service_mine.close()
            raise OSError(f"the gRPC front process could not listen on {config.host}:{config.port}")
        services = ServiceChannel(FrameSocket(service_mine), servicer, config.grpc_workers, on_lost)
        services.start()
        hotpath = HotPath(wire, worker, engine, on_lost)
        hotpath.start()
        return cls(proc, hotpath, services, int(hello[1]))

    def stop(self, timeout: float = 15.0) -> None:
        """Close the hot socket; the child drains its calls (forwarded ones still answered over the
        service channel) and exits (killed if it does not); then close the service channel."""
        self.services.expect_close()
        self.hotpath.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the gRPC front process did not exit in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.services.close()
