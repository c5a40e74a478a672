"""Replica subprocesses on loopback for benchmarks and tests: start, read the ready line, stop.

    ports = free_ports(2)
    table = write_loopback_ranks(folder / "ranks.json", ports)
    with ReplicaProcess.start(model_dir, "--num-blocks", "128", "--cluster", str(table)) as replica:
        channel = grpc.insecure_channel(replica.address)

Every wait has a deadline; the process is stopped with SIGTERM (then SIGKILL) on exit. Part of the
installed package (the benchmarks use it), so it imports nothing from `tests/`.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.processes import pdcluster_argv
from transfer.ports import free_port_run, free_ports

__all__ = ["ReplicaProcess", "free_port_run", "free_ports", "write_loopback_ranks"]

REPO = SOURCE_ROOT  # where the replica starts: relative paths in its arguments mean the same as here
READY_PREFIX = "pdcluster replica serving on"


@dataclass
class ReplicaProcess:
    """A running replica subprocess and the address it serves on."""

    process: subprocess.Popen[str]
    address: str
    stderr_lines: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, model: Path, *args: str, timeout: float = 60.0, log: Path | None = None
    ) -> ReplicaProcess:
        """Launch `pdcluster replica --model MODEL --port 0 ARGS...` and wait for its ready line.

        The replica's log lines are kept in `stderr_lines` and, with `log`, also written to that file.
        """
        cmd = pdcluster_argv("replica", "--model", str(model), "--port", "0", *args)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        stderr: list[str] = []
        threading.Thread(target=_pump, args=(proc.stdout, lines.put), daemon=True).start()
        threading.Thread(target=_pump_log, args=(proc.stderr, stderr, log), daemon=True).start()
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


def write_loopback_ranks(
    path: Path, ports: list[int], link_gbps: float = 0.0, one_node: bool = False
) -> Path:
    """A rank table of `len(ports)` CPU ranks on loopback written as JSON to `path`.

    Each rank is a node of its own (behind its own emulated NIC when `link_gbps` > 0), or with
    `one_node` all share node "n0".
    """
    ranks = [
        {
            "rank": rank,
            "host": "127.0.0.1",
            "node": "n0" if one_node else f"n{rank}",
            "device": "cpu",
            "transfer_address": f"127.0.0.1:{port}",
            "link_gbps": link_gbps,
        }
        for rank, port in enumerate(ports)
    ]
    path.write_text(json.dumps({"ranks": ranks}))
    return path


def _pump_log(stream: IO[str] | None, lines: list[str], log: Path | None) -> None:
    """Keep the replica's log lines in `lines` and, with `log`, also in that file (closed at EOF)."""
    if log is None:
        _pump(stream, lines.append)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:

        def keep(line: str) -> None:
            lines.append(line)
            out.write(line + "\n")
            out.flush()

        _pump(stream, keep)


def _pump(stream: IO[str] | None, sink: Callable[[str], None]) -> None:
    if stream is None:
        return
    for line in stream:
        sink(line.rstrip("\n"))
