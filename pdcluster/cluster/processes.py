"""Processes pdcluster starts: a child that dies with us, its log, its ready line, its restart, its stop.

```
 spawn(name, role, argv, log) ─► Proc: stdout lines → the log (and the ready line → `ready`),
                                       stderr → the log, SIGTERM when this process dies
 Proc.respawn()               ─► the same argv again (a supervised restart), log appended
 stop_procs(router, replicas) ─► SIGTERM group by group; SIGKILL what outlives the timeout
 last_error_line(log)         ─► the line that says why a process ended, for one-line messages
```
Shared by `pdcluster up` (`local.py`), `pdcluster launch` (`launch.py`) and the supervisor.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster import SOURCE_ROOT

REPLICA_READY = "pdcluster replica serving on "
ROUTER_READY = "pdcluster router ready:"
_TAIL_LINES = 200
_PR_SET_PDEATHSIG = 1
_SETPRIV = shutil.which("setpriv")  # util-linux; without it children are not tied to this process


def pdcluster_argv(*args: str) -> list[str]:
    """`pdcluster ARGS...` run by this interpreter (no dependence on PATH or the console script)."""
    return [sys.executable, "-m", "pdcluster", *args]


def _die_with_parent() -> None:
    """In the child before exec, where setpriv is missing: SIGTERM when the parent dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exec_argv(argv: list[str], cpus: frozenset[int] | None = None) -> list[str]:
    """`argv` run so that it gets SIGTERM when this process dies (and only on `cpus`, when given).

    Done by exec wrappers (util-linux `setpriv --pdeathsig`, `taskset`), not in a `preexec_fn` (the
    fallback where setpriv is missing): a preexec_fn makes Python fork (not vfork), and a fork of a
    process using gRPC runs gRPC's fork handlers, which now and then abort the child before it execs
    (a replica that "exited with -6" having logged only "epoll_wait error: Bad file descriptor";
    4 in 200 spawns here from a process serving gRPC). The signal is armed once setpriv runs, a
    millisecond after the spawn: a parent killed within it leaves that child running.
    """
    wrapped = list(argv)
    if cpus is not None:
        wrapped = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *wrapped]
    if _SETPRIV is not None:
        wrapped = [_SETPRIV, "--pdeathsig", "TERM", "--", *wrapped]
    return wrapped


@dataclass
class Proc:
    """One supervised process: how to start it, its log, and what it printed."""

    name: str
    role: str
    argv: list[str]
    log: Path
    ready_prefix: str = ""
    cpus: frozenset[int] | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None  # written to its stdin once, then closed (None: /dev/null)
    node: str = ""  # where it runs, for messages ("" = here)
    address: str = ""
    ready_line: str = ""  # the ready line of the current run ("" until printed)
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts
    exits: list[int] = field(default_factory=list)  # exit codes of its ended runs
    _popen: subprocess.Popen[str] | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))

    def start(self, append: bool = False) -> None:
        """Start (or start again) the process; stdout lines go to the log and are watched."""
        self.ready_line = ""
        self._ready.clear()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            self.log.write_text("")
        # O_APPEND for the child's stderr too: the pump appends its stdout lines to the same file, and
        # a write at the child's own offset would overwrite them.
        with self.log.open("a") as err:
            self._popen = subprocess.Popen(
                exec_argv(self.argv, self.cpus), stdout=subprocess.PIPE, stderr=err, text=True,
                cwd=SOURCE_ROOT,
                stdin=subprocess.PIPE if self.stdin is not None else subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
                preexec_fn=None if _SETPRIV else _die_with_parent)
        pump = threading.Thread(target=self._pump, args=(self._popen,), daemon=True, name=f"pump-{self.name}")
        pump.start()
        if self.stdin is not None:
            threading.Thread(target=_feed, args=(self._popen, self.stdin), daemon=True).start()

    @property
    def popen(self) -> subprocess.Popen[str]:
        """The current run's process."""
        assert self._popen is not None, f"{self.name} was never started"
        return self._popen

    def respawn(self) -> None:
        """Start the same command again (the log is appended to)."""
        self.restarts.append(time.monotonic())
        self.start(append=True)

    def _pump(self, popen: subprocess.Popen[str]) -> None:
        """Copy stdout to the log and catch the ready line (a thread; keeps the pipe drained)."""
        assert popen.stdout is not None
        with self.log.open("a") as out:
            for raw in popen.stdout:
                line = raw.rstrip("\r\n")  # a remote terminal (ssh -tt) ends lines with \r\n
                out.write(line + "\n")
                out.flush()
                self._tail.append(line)
                if self.ready_prefix and not self.ready_line and self.ready_prefix in line:
                    # from the prefix on: a partial line another process of the session (a library
                    # of a tp worker writing to the shared stream) left just before it is not part of it
                    self.ready_line = line[line.index(self.ready_prefix):]
                    self._ready.set()

    @property
    def started(self) -> bool:
        """It was started (it may have ended since)."""
        return self._popen is not None

    @property
    def running(self) -> bool:
        """Started and not ended."""
        return self._popen is not None and self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code of the current run (None while it runs)."""
        return None if self._popen is None else self._popen.poll()

    @property
    def ready(self) -> bool:
        """It runs, and this run printed its ready line."""
        return self._ready.is_set() and self.running

    def wait_ready(self, deadline: float) -> str:
        """The ready line (RuntimeError naming the cause if the process ends first or is late)."""
        while not self._ready.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            code = self.returncode
            if code is not None and not self._ready.is_set():
                time.sleep(0.2)  # let the pump write the last lines of the log
                if not self._ready.is_set():
                    raise RuntimeError(self.exit_message(code))
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.where} printed no ready line in time{self._cause()} "
                                   f"(log: {self.log})")
        return self.ready_line

    @property
    def where(self) -> str:
        """The name, and the node when it runs elsewhere."""
        return f"{self.name} on {self.node}" if self.node else self.name

    def _cause(self) -> str:
        line = last_error_line(self.log)
        return f": {line}" if line else ""

    def exit_message(self, code: int) -> str:
        """"NAME exited with CODE: CAUSE (log: …)", the cause read from its log."""
        return f"{self.where} exited with {code}{self._cause()} (log: {self.log})"

    def tail(self, n: int = 8) -> list[str]:
        """The last `n` lines of its log."""
        return _read_tail(self.log, n)


def _feed(popen: subprocess.Popen[str], text: str) -> None:
    assert popen.stdin is not None
    with contextlib.suppress(OSError):
        popen.stdin.write(text)
        popen.stdin.close()


def spawn(name: str, role: str, argv: list[str], log: Path, cpus: frozenset[int] | None = None,
          ready_prefix: str = "", env: dict[str, str] | None = None, node: str = "") -> Proc:
    """Start `argv` (stdin /dev/null, so e.g. `ssh -tt` never takes our terminal), dying with us.

    `cpus`: the cores it (and every thread it starts) may run on.
    """
    proc = Proc(name, role, argv, log, ready_prefix, cpus, env, node=node)
    proc.start()
    return proc


def stop_procs(*groups: list[Proc], timeout: float = 10.0) -> None:
    """SIGTERM each group in turn (waiting for it before the next); SIGKILL what outlives `timeout`."""
    for group in groups:
        started = [p.popen for p in group if p.started]
        for popen in started:
            if popen.poll() is None:
                popen.terminate()
        for popen in started:
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout)


def parse_router_ready(line: str) -> tuple[str, str]:
    """(http URL, admin address) from the router's ready line."""
    fields = dict(part.split("=", 1) for part in line[len(ROUTER_READY):].split() if "=" in part)
    return fields["http"], fields["admin"]


# --- why a process ended -----------------------------------------------------------------------

_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]*(Error|Exception|Exit|Interrupt|Refused|NotFound)"
                        r"(: .*)?$")
_MARKED = re.compile(r"(^pdcluster [\w -]+: |\bdoes not exist|\bERROR|\bCRITICAL|\bFATAL|\b[Ee]rror:|"
                     r"[Ff]atal:|Permission denied|[Cc]ould not|[Cc]annot|[Cc]an't|[Nn]o such file|"
                     r"Address already in use|refused)")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s+")


def _read_tail(log: Path, n: int) -> list[str]:
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line.rstrip("\r") for line in text.splitlines() if line.strip()][-n:]


def last_error_line(log: Path) -> str:
    """The line of `log` that says why its process ended: the last exception line of a traceback,
    else the last line marked as an error, else "" (the caller names the log instead)."""
    lines = _read_tail(log, _TAIL_LINES)
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()):
            return line.strip()
    for line in reversed(lines):
        if _MARKED.search(line) and not line.lstrip().startswith(("Traceback", "File ")):
            return _STAMP.sub("", line.strip())
    return ""
