"""`pdcluster up`: a whole cluster on this machine — N prefill + M decode (+ K inactive) replica
processes and a router — with one ready line, and a clean stop of everything it started.

```
 pdcluster up ─┬─ pdcluster replica --rank 0 (prefill)   ─┐ stdout: "pdcluster replica serving on H:P"
               ├─ pdcluster replica --rank 1 (decode)    ─┤
               └─ pdcluster router --replica H:P … --role …  stdout: "pdcluster router ready: http=… admin=…"
```
Children get SIGTERM when this process dies (Linux parent-death signal), so none is orphaned even
if `pdcluster up` itself is killed; on Ctrl-C / SIGTERM the router stops first, then the replicas.
`LocalCluster` is the same thing as a context manager (used by the demo and the cluster tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Protocol

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.replica_process import free_ports
from router.config import Strategy

REPLICA_READY = "pdcluster replica serving on "
ROUTER_READY = "pdcluster router ready:"
_PR_SET_PDEATHSIG = 1


@dataclass
class UpConfig:
    """Flags of `pdcluster up`."""

    model: Path = field(metadata={"help": "checkpoint folder"})
    prefill: int = field(default=1, metadata={"help": "prefill replicas"})
    decode: int = field(default=1, metadata={"help": "decode replicas"})
    inactive: int = field(default=0, metadata={"help": "inactive replicas (no weights; scale-up targets)"})
    strategy: Strategy = field(default=Strategy.FULL, metadata={"help": "migration strategy"})
    http_port: int = field(default=8080, metadata={"help": "router HTTP port (0 = free port)"})
    admin_port: int = field(default=50100, metadata={"help": "router admin gRPC port (0 = free port)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address every process binds"})
    num_blocks: int = field(default=512, metadata={"help": "KV pages per replica"})
    admin_token: str = field(default="", metadata={"help": "admin token of the router (empty = none)"})
    log_dir: Path | None = field(default=None, metadata={"help": "folder of process logs (default: temp)"})
    ready_timeout: float = field(default=180.0, metadata={"help": "seconds to wait for each ready line"})
    torch_threads: int = field(default=0, metadata={"help": (
        "torch threads per replica; 0 = this machine's cores shared among the replicas (at least 1)")})
    pin_decode: bool = field(default=False, metadata={"help": (
        "give each decode replica's engine thread a CPU core of its own (`--engine-cpus`; the router, the "
        "prefill and inactive replicas and the decode replicas' other threads and gRPC front processes "
        "share the other cores), as each would have its own device in a real deployment")})

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if isinstance(self.strategy, str):
            self.strategy = Strategy(self.strategy)
        if min(self.prefill, self.decode, self.inactive) < 0 or self.prefill + self.decode < 1:
            raise ValueError("need at least one prefill or decode replica, and no negative counts")


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Placement:
    """CPU cores of a local cluster: a core of its own for each decode replica's engine thread."""

    decode: tuple[frozenset[int], ...]  # engine thread of each decode replica, in rank order
    shared: frozenset[int]  # everything else (the decode replicas' other threads and fronts too)

    @classmethod
    def plan(cls, decode: int, cores: set[int] | None = None) -> Placement:
        """The last `decode` cores go one to each decode replica; at least one core stays shared."""
        ordered = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if decode >= len(ordered):
            raise ValueError(f"--pin-decode: {decode} decode replica(s) need more than {len(ordered)} cores")
        own = ordered[len(ordered) - decode:]
        return cls(tuple(frozenset([c]) for c in own), frozenset(ordered[: len(ordered) - decode]))

    def describe(self) -> str:
        """A short text for logs and benchmark summaries."""
        decode = ",".join(str(min(c)) for c in self.decode)
        return f"decode engine threads on cores [{decode}], everything else on {sorted(self.shared)}"


@dataclass
class Proc:
    """One started process: its role, its ready address, its log."""

    name: str
    role: str
    popen: subprocess.Popen[str]
    log: Path
    address: str = ""
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

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


class LocalCluster:
    """Start replicas and a router as subprocesses; `stop()` ends every one of them."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pdcluster-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list[Proc] = []
        self.router: Proc | None = None
        self.http_url = ""
        self.admin_address = ""
        self.placement = Placement.plan(config.decode) if config.pin_decode else None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.stop()

    def _spawn(self, name: str, role: str, args: list[str], cpus: frozenset[int] | None = None) -> Proc:
        argv = [sys.executable, "-m", "pdcluster", *args]
        return spawn(name, role, argv, self.log_dir / f"{name}.log", cpus)

    def _cpus(self, role: str, decode_index: int) -> frozenset[int] | None:
        """The cores of one process (None: not pinned); a decode replica puts its engine thread on its
        own core and the rest of itself on the shared ones (`_engine_args`)."""
        if self.placement is None:
            return None
        if role == "decode":
            return self.placement.shared | self.placement.decode[decode_index]
        return self.placement.shared

    def _engine_args(self, role: str, decode_index: int) -> list[str]:
        """`--engine-cpus CORE` of a pinned decode replica (nothing otherwise)."""
        if self.placement is None or role != "decode":
            return []
        return ["--engine-cpus", *map(str, sorted(self.placement.decode[decode_index]))]

    def roles(self) -> list[str]:
        """The role of each replica, by rank."""
        c = self.config
        return ["prefill"] * c.prefill + ["decode"] * c.decode + ["inactive"] * c.inactive

    def start(self) -> None:
        """Start every replica, wait for their ready lines, then the router and its ready line."""
        c = self.config
        # Replicas on one machine would each take every core and thrash: share them out instead (a pinned
        # decode replica has one core).
        shared = max(1, (os.cpu_count() or 1) // len(self.roles()))
        threads = c.torch_threads or (1 if self.placement else shared)
        fabric = self._fabric_args()
        for rank, role in enumerate(self.roles()):
            args = ["replica", "--model", str(c.model), "--host", c.host, "--port", "0", "--rank", str(rank),
                    "--num-blocks", str(c.num_blocks), "--torch-threads", str(threads), *fabric]
            if role == "inactive":
                args.append("--inactive")
            args += self._engine_args(role, rank - c.prefill)
            cpus = self._cpus(role, rank - c.prefill)
            self.replicas.append(self._spawn(f"replica-{rank}-{role}", role, args, cpus))
        deadline = time.monotonic() + c.ready_timeout
        for proc in self.replicas:
            proc.address = proc.wait_line(REPLICA_READY, deadline)[len(REPLICA_READY):].strip()
        args = ["router", "--model", str(c.model), "--host", c.host, "--http-port", str(c.http_port),
                "--admin-port", str(c.admin_port), "--strategy", c.strategy.value,
                "--replica", *[p.address for p in self.replicas], "--role", *self.roles()]
        if c.admin_token:
            args += ["--admin-token", c.admin_token]
        self.router = self._spawn("router", "router", args, self._cpus("router", 0))
        line = self.router.wait_line(ROUTER_READY, time.monotonic() + c.ready_timeout)
        self.http_url, self.admin_address = parse_router_ready(line)

    def _fabric_args(self) -> list[str]:
        """`--cluster RANKS --fabric tcp`: a rank table of this machine, one free port per replica."""
        from transfer.ranktable import RankTable

        table = RankTable.local(free_ports(len(self.roles()), self.config.host), self.config.host)
        path = self.log_dir / "ranks.json"
        path.write_text(table.to_json())
        return ["--cluster", str(path), "--fabric", "tcp"]

    def ready_line(self) -> str:
        """The one line `pdcluster up` prints once everything serves."""
        reps = " ".join(f"{p.role}@{p.address}" for p in self.replicas)
        pinned = f" pinned=({self.placement.describe()})" if self.placement else ""
        return (f"pdcluster up ready: http={self.http_url} admin={self.admin_address} "
                f"strategy={self.config.strategy.value} replicas=[{reps}] logs={self.log_dir}{pinned}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router, then the replicas; SIGKILL whatever is still alive after `timeout`."""
        stop_procs([self.router] if self.router else [], self.replicas, timeout=timeout)


def spawn(name: str, role: str, argv: list[str], log: Path, cpus: frozenset[int] | None = None) -> Proc:
    """Start `argv` (stdout piped and pumped into `Proc.lines`, stderr to `log`), dying with us.

    stdin is /dev/null: a child (e.g. `ssh -tt`) must never take over this process's terminal.
    `cpus`: the cores it (and every thread it starts) may run on.
    """

    def before_exec() -> None:
        _die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    popen = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        preexec_fn=before_exec,
        cwd=SOURCE_ROOT,
    )
    proc = Proc(name, role, popen, log)
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


def run(config: UpConfig) -> int:
    """Entry point of `pdcluster up`: start, print the ready line, run until Ctrl-C / SIGTERM."""
    return supervise("pdcluster up", LocalCluster(dataclasses.replace(config)))
