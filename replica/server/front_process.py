"""`FrontProcess`: starts the gRPC front process (`frontend.py`) and wires its socket to `HotPath`.

```
 serve(): internal gRPC server on 127.0.0.1:0 ── FrontProcess.start ──► child binds --host:--port
          ◄── ("port", P) ── ready line names P; hot calls flow over the socket pair (hotpath.py)
 stop:    close the socket ──► child stops its server and exits (killed after a grace period)
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
from replica.server.wire import FrameSocket

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]  # the folder holding the `replica` package
_START_TIMEOUT = 60.0  # seconds for the child to import grpc and bind


class FrontProcess:
    """The running front process and the replica's end of its socket pair."""

    def __init__(self, proc: subprocess.Popen[bytes], hotpath: HotPath, port: int) -> None:
        self.proc = proc
        self.hotpath = hotpath
        self.port = port

    @classmethod
    def start(
        cls,
        config: ReplicaConfig,
        internal_address: str,
        worker: EngineWorker,
        engine: Callable[[], Engine | None],
        on_lost: Callable[[], None],
    ) -> FrontProcess:
        """Spawn the child, wait for its bound port, start serving its calls."""
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "replica.server.frontend", "--fd", str(theirs.fileno()),
               "--host", config.host, "--port", str(config.port), "--backend", internal_address,
               "--workers", str(config.grpc_workers)]  # fmt: skip
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, env=env)  # fmt: skip
        theirs.close()
        wire = FrameSocket(mine)
        mine.settimeout(_START_TIMEOUT)
        hello = wire.recv()
        mine.settimeout(None)
        if not (isinstance(hello, tuple) and hello[0] == "port" and hello[1]):
            proc.kill()
            proc.wait()
            raise OSError(f"the gRPC front process could not listen on {config.host}:{config.port}")
        hotpath = HotPath(wire, worker, engine, on_lost)
        hotpath.start()
        return cls(proc, hotpath, int(hello[1]))

    def stop(self, timeout: float = 15.0) -> None:
        """Close the socket; the child drains its calls and exits (killed if it does not)."""
        self.hotpath.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the gRPC front process did not exit in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.wait()
