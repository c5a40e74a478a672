"""Processes pdcluster starts and supervises: a child that dies with us, its ready line, its stop.

```
 spawn(name, role, argv, log) ─► Proc: stdout lines → a queue (wait_line(prefix, deadline)),
                                       stderr → log, SIGTERM when this process dies
 stop_procs(router, replicas)  ─► SIGTERM group by group; SIGKILL what outlives the timeout
 supervise(tool, cluster)      ─► start, print the ready line, run until Ctrl-C / SIGTERM, stop
```
Shared by `pdcluster up` (`pdcluster.cluster.local`) and `pdcluster launch` (`pdcluster.cluster.launch`).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Protocol

from pdcluster import SOURCE_ROOT

REPLICA_READY = "pdcluster replica serving on "
ROUTER_READY = "pdcluster router ready:"


def pdcluster_argv(*args: str) -> list[str]:
    """`pdcluster ARGS...` run by this interpreter (no dependence on PATH or the console script)."""
    return [sys.executable, "-m", "pdcluster", *args]


def _wrapped(argv: list[str], cpus: frozenset[int] | None) -> list[str]:
    """`argv` behind `setpriv --pdeathsig TERM` (SIGTERM when the spawning thread dies; Linux) and
    `taskset` (its cores): both set before exec, with no Python code in the forked child.

    A `preexec_fn` would do the same, but it makes `subprocess` fork (not vfork) and run gRPC's
    fork handlers while other threads of this process are in gRPC calls (a benchmark's probes): the
    child then aborted now and then before exec (`epoll_wait error: Bad file descriptor`, exit -6).
    """
    if cpus is not None:
        argv = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *argv]
    return ["setpriv", "--pdeathsig", "TERM", *argv]


@dataclass
class Proc:
    """One started process: its role, its ready address, its log."""

    name: str
    role: str
    popen: subprocess.Popen[str]
    log: Path
    address: str = ""
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    argv: list[str] = field(default_factory=list)  # as given to `spawn` (a restart runs it again)

    def pump(self) -> None:
        """Forward stdout lines to the queue (a thread; keeps the pipe drained)."""
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_line(self, prefix: str, deadline: float) -> str:
        """The first stdout line starting with `prefix` (RuntimeError on exit or past the deadline)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} printed no ready line in time (log: {self.log})")
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.popen.poll() is not None and self.lines.empty():
                    raise RuntimeError(f"{self.name} exited with {self.popen.returncode} (log: {self.log})"
                                       ) from None
                continue
            if line.startswith(prefix):
                return line



def spawn(name: str, role: str, argv: list[str], log: Path, cpus: frozenset[int] | None = None) -> Proc:
    """Start `argv` (stdout piped and pumped into `Proc.lines`, stderr to `log`), dying with us.

    stdin is /dev/null: a child (e.g. `ssh -tt`) must never take over this process's terminal.
    `cpus`: the cores it (and every thread it starts) may run on.
    """

    popen = subprocess.Popen(
        _wrapped(argv, cpus), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log.open("w"),
        text=True, cwd=SOURCE_ROOT,
    )
    proc = Proc(name, role, popen, log, argv=list(argv))
    threading.Thread(target=proc.pump, daemon=True, name=f"pump-{name}").start()
    return proc


def stop_procs(*groups: list[Proc], timeout: float = 10.0) -> None:
    """SIGTERM each group in turn (waiting for it before the next); SIGKILL what outlives `timeout`."""
    for group in groups:
        for proc in group:
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in group:
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout)


def parse_router_ready(line: str) -> tuple[str, str]:
    """(http URL, admin address) from the router's ready line."""
    fields = dict(part.split("=", 1) for part in line[len(ROUTER_READY):].split() if "=" in part)
    return fields["http"], fields["admin"]


class Supervised(Protocol):
    """What `supervise` runs: a set of started processes with a router (LocalCluster, Launch)."""

    replicas: list[Proc]
    router: Proc | None

    def start(self) -> None: ...
    def ready_line(self) -> str: ...
    def stop(self) -> None: ...


def supervise(tool: str, cluster: Supervised) -> int:
    """Start `cluster`, print its ready line, report each process that exits, and stop everything on
    Ctrl-C / SIGTERM (exit 0) or once the router has exited (exit 1)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        print(cluster.ready_line(), flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            procs = [*cluster.replicas, *([cluster.router] if cluster.router else [])]
            for proc in procs:
                if proc.popen.poll() is not None and proc.name not in reported:
                    reported.add(proc.name)
                    print(f"{tool}: {proc.name} exited with {proc.popen.returncode} (log: {proc.log})",
                          file=sys.stderr, flush=True)
            if cluster.router is not None and cluster.router.popen.poll() is not None:
                return 1
    except RuntimeError as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0
