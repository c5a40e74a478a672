"""`FrontProcess`: the front-process placement — starts `frontend.py` and serves its two sockets.

```
 FrontProcess.start ──► child binds --host:--port ──Hello(P)──► the ready line names P
          hot socket ──► EngineLane (read by the engine thread)      } lanes.py, over the same
          service socket ──► ServiceLane (its own threads)           } ReplicaCore as in-process
 set_serving ──Serving(bool)──► the child's grpc.health.v1
 stop:    close the hot socket ──► child stops its server (in-flight calls finish) and exits
          (killed after a grace period); then the service socket closes
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
from replica.server.core import ReplicaCore
from replica.server.frames import FrameSocket, Hello, ToReplica
from replica.server.lanes import EngineLane, ServiceLane

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]  # the folder holding the `replica` package
_START_TIMEOUT = 60.0  # seconds for the child to import grpc and bind


class FrontProcess:
    """The running front process and the replica's ends of its two socket pairs."""

    def __init__(
        self, proc: subprocess.Popen[bytes], engine: EngineLane, service: ServiceLane, port: int
    ) -> None:
        self.proc = proc
        self.engine = engine
        self.service = service
        self.port = port

    @classmethod
    def start(cls, config: ReplicaConfig, core: ReplicaCore, on_lost: Callable[[], None]) -> FrontProcess:
        """Spawn the child, wait for its bound port, start serving its calls."""
        mine, theirs = socket.socketpair()
        service_mine, service_theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "replica.server.frontend", "--fd", str(theirs.fileno()),
               "--service-fd", str(service_theirs.fileno()), "--host", config.host,
               "--port", str(config.port), "--workers", str(config.grpc_workers)]  # fmt: skip
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), service_theirs.fileno()),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)  # fmt: skip
        theirs.close()
        service_theirs.close()
        wire = FrameSocket(mine, ToReplica)
        mine.settimeout(_START_TIMEOUT)
        hello = wire.recv()
        mine.settimeout(None)
        if not (isinstance(hello, Hello) and hello.port):
            proc.kill()
            proc.wait()
            mine.close()
            service_mine.close()
            raise OSError(f"the gRPC front process could not listen on {config.host}:{config.port}")
        service = ServiceLane(FrameSocket(service_mine, ToReplica), core, config.grpc_workers, on_lost)
        service.start()
        engine = EngineLane(wire, core.worker, core, on_lost)
        engine.start()
        return cls(proc, engine, service, hello.port)

    def set_serving(self, serving: bool) -> None:
        """What the front's grpc.health.v1 says."""
        self.service.publish(serving)

    def stop(self, timeout: float = 15.0) -> None:
        """Close the hot socket; the child drains its calls (service calls still answered over the
        service socket) and exits (killed if it does not); then close the service socket."""
        self.service.expect_close()
        self.engine.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the gRPC front process did not exit in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.service.close()
