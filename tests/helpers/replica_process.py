"""Start a `pdcluster replica` subprocess on loopback and read the address it prints once ready.

    with ReplicaProcess.start(model_dir, "--num-blocks", "128") as replica:
        channel = grpc.insecure_channel(replica.address)

Every wait has a deadline; the process is stopped with SIGTERM (then SIGKILL) on exit.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
READY_PREFIX = "pdcluster replica serving on"


@dataclass
class ReplicaProcess:
    """A running replica subprocess and the address it serves on."""

    process: subprocess.Popen[str]
    address: str
    stderr_lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, model: Path, *args: str, timeout: float = 60.0) -> ReplicaProcess:
        """Launch `pdcluster replica --model MODEL --port 0 ARGS...` and wait for its ready line."""
        cmd = [sys.executable, "-m", "scripts.cli", "replica", "--model", str(model), "--port", "0", *args]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        stderr: list[str] = []
        threading.Thread(target=_pump, args=(proc.stdout, lines.put), daemon=True).start()
        threading.Thread(target=_pump, args=(proc.stderr, stderr.append), daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line or not line.startswith(READY_PREFIX):
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"replica did not get ready: {line!r}\n{''.join(stderr[-30:])}")
        return cls(proc, line.split()[-1], stderr)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode

    def __enter__(self) -> ReplicaProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _pump(stream: object, sink: object) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink(line.rstrip("\n"))  # type: ignore[operator]
