"""`pdcluster launch`: replicas across nodes (ssh or Slurm srun), then the router here, one ready line.

```
 pdcluster launch ─┬─ ssh -tt node1 '…; exec pdcluster replica --rank 0 …'      ─┐ streamed back:
                   ├─ srun --nodelist=node2 bash -c '…; exec pdcluster replica …' ─┤ "…serving on H:P"
                   └─ pdcluster router --replica H:P … --role …  (here)  "pdcluster router ready: …"
```
Placement, the rank table and the commands are pure data (`pdcluster.cluster.launch_plan`); the process
wrapper, ready-line waiting and stop logic are `pdcluster.cluster.processes`'s. On Ctrl-C / SIGTERM the
router stops first, then every ssh/srun/local process: killing `ssh -tt` hangs up the remote
terminal (the replica, exec'd as the session's process, gets SIGHUP); SIGTERM to srun is forwarded
to its step.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.launch_plan import (
    Node,
    Placement,
    Transport,
    assign,
    parse_hosts,
    rank_table,
    remote_script,
    replica_args,
    router_args,
    wrap,
)
from pdcluster.cluster.processes import (
    REPLICA_READY,
    ROUTER_READY,
    Proc,
    parse_router_ready,
    pdcluster_argv,
    spawn,
    stop_procs,
    supervise,
)
from router.config import Strategy

ROOT = SOURCE_ROOT


@dataclass
class LaunchConfig:
    """Flags of `pdcluster launch`."""

    model: Path = field(metadata={"help": "checkpoint folder (same path on every node)"})
    hosts: Path | None = field(default=None, metadata={"help": (
        "hosts file: one `host [slots=N] [transfer_host=IP]` per line, # comments")})
    slurm: bool = field(default=False, metadata={"help": (
        "nodes from SLURM_JOB_NODELIST (scontrol show hostnames)")})
    slots: int = field(default=1, metadata={"help": "replicas per node with --slurm"})
    prefill: int = field(default=1, metadata={"help": "prefill replicas"})
    decode: int = field(default=1, metadata={"help": "decode replicas"})
    inactive: int = field(default=0, metadata={"help": "inactive replicas (no weights; scale-up targets)"})
    base_port: int = field(default=50051, metadata={"help": (
        "gRPC port of a node's first replica (+1 per slot)")})
    transfer_base_port: int = field(default=7100, metadata={"help": (
        "transfer port of a node's first replica (+1 per slot)")})
    strategy: Strategy = field(default=Strategy.FULL, metadata={"help": "migration strategy"})
    http_port: int = field(default=8080, metadata={"help": "router HTTP port (0 = free port)"})
    admin_port: int = field(default=50100, metadata={"help": "router admin gRPC port (0 = free port)"})
    router_host: str = field(default="127.0.0.1", metadata={"help": "address the router binds here"})
    python: str = field(default="", metadata={"help": (
        "pdcluster command on the nodes (a path or a command line); empty = this venv's pdcluster")})
    workdir: Path = field(default=ROOT, metadata={"help": "folder the replicas start in on every node"})
    transport: Transport = field(default=Transport.SSH, metadata={"help": "how replicas are started"})
    shared_dir: Path | None = field(default=None, metadata={"help": (
        "folder shared by all nodes for the rank table; unset = sent inline to each node")})
    num_blocks: int = field(default=512, metadata={"help": "KV pages per replica"})
    torch_threads: int = field(default=0, metadata={"help": (
        "torch threads per replica (0 = the replica's default)")})
    log_dir: Path | None = field(default=None, metadata={"help": "folder of process logs; unset = temp"})
    ready_timeout: float = field(default=300.0, metadata={"help": "seconds to wait for all ready lines"})
    dry_run: bool = field(default=False, metadata={"help": (
        "print the rank table and every command; start nothing")})

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if isinstance(self.strategy, str):
            self.strategy = Strategy(self.strategy)
        if isinstance(self.transport, str):
            self.transport = Transport(self.transport)
        if (self.hosts is None) == (not self.slurm):
            raise ValueError("give exactly one of --hosts FILE and --slurm")
        if min(self.prefill, self.decode, self.inactive) < 0 or self.prefill + self.decode < 1:
            raise ValueError("need at least one prefill or decode replica, and no negative counts")

    def roles(self) -> list[str]:
        """The role of each replica, by rank."""
        return ["prefill"] * self.prefill + ["decode"] * self.decode + ["inactive"] * self.inactive


def slurm_nodes(nodelist: str, slots: int) -> list[Node]:
    """Nodes of a Slurm allocation (`scontrol show hostnames` expands the compressed list)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return [Node(host, slots) for host in out.split()]


def pdcluster_command(python: str) -> list[str]:
    """The pdcluster command line on the nodes."""
    if python:
        return shlex.split(python)
    script = Path(sys.executable).parent / "pdcluster"
    return [str(script)] if script.exists() else pdcluster_argv()


class Launch:
    """Plan, start, wait for and stop one multi-node cluster."""

    def __init__(self, config: LaunchConfig, nodes: list[Node]) -> None:
        self.config = config
        self.placements = assign(config.roles(), nodes, config.base_port, config.transfer_base_port)
        self.table_json = rank_table(self.placements).to_json()
        # Names this run's log folder here and its rank-table folder on the nodes (nothing is created yet).
        self.run_id = f"pdcluster-launch-{os.getpid()}-{int(time.time())}"
        self.log_dir = config.log_dir or Path(tempfile.gettempdir()) / self.run_id
        self.replicas: list[Proc] = []
        self.router: Proc | None = None
        self.http_url = ""
        self.admin_address = ""

    def _ranks_path(self, rank: int) -> Path:
        if self.config.shared_dir is not None:
            return self.config.shared_dir / f"{self.run_id}-ranks.json"
        # One file per rank: ranks sharing a node must not rewrite each other's file while it is read.
        return Path("/tmp") / self.run_id / f"ranks-r{rank}.json"

    def node_log(self, rank: int) -> Path:
        """Where replica `rank` writes its stderr, on its node."""
        return Path("/tmp") / self.run_id / f"replica-{rank}.log"

    def replica_argv(self, p: Placement) -> list[str]:
        """The local argv that starts replica `p` on its node."""
        c = self.config
        extra = ["--num-blocks", str(c.num_blocks)]
        extra += ["--torch-threads", str(c.torch_threads)] if c.torch_threads else []
        path = self._ranks_path(p.rank)
        args = replica_args(p, c.model, path, extra)
        inline = None if c.shared_dir is not None else self.table_json
        script = remote_script(pdcluster_command(c.python), args, c.workdir, path, inline,
                               self.node_log(p.rank))
        return wrap(c.transport, p.node.host, script, p.rank)

    def dry_run(self) -> str:
        """The rank table and every command, as text."""
        lines = ["# rank table", self.table_json]
        lines += [f"# rank {p.rank} ({p.role}) on {p.node.host}\n{shlex.join(self.replica_argv(p))}"
                  for p in self.placements]
        router = router_args(self.placements, [p.address for p in self.placements], self.config.model,
                             self.config.router_host, self.config.http_port, self.config.admin_port,
                             self.config.strategy.value)
        return "\n".join([*lines, "# router (here)", shlex.join(["pdcluster", *router])])

    def start(self) -> None:
        """Start every replica, wait for their ready lines, then the router and its ready line."""
        c = self.config
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if c.shared_dir is not None:
            self._ranks_path(0).write_text(self.table_json)
        for p in self.placements:
            name = f"replica-{p.rank}-{p.role}"
            log = self.log_dir / f"{name}.log"  # the ssh/srun side; the replica's own log is on its node
            proc = spawn(f"{name} on {p.node.host} (node log {self.node_log(p.rank)})", p.role,
                         self.replica_argv(p), log)
            self.replicas.append(proc)
        deadline = time.monotonic() + c.ready_timeout
        for proc in self.replicas:
            proc.address = proc.wait_line(REPLICA_READY, deadline)[len(REPLICA_READY):].strip()
        args = router_args(self.placements, [p.address for p in self.replicas], c.model, c.router_host,
                           c.http_port, c.admin_port, c.strategy.value)
        self.router = spawn("router", "router", pdcluster_argv(*args),
                            self.log_dir / "router.log")
        line = self.router.wait_line(ROUTER_READY, time.monotonic() + c.ready_timeout)
        self.http_url, self.admin_address = parse_router_ready(line)

    def ready_line(self) -> str:
        """The one line `pdcluster launch` prints once everything serves."""
        reps = " ".join(f"{p.role}@{p.address}" for p in self.replicas)
        return (f"pdcluster launch ready: http={self.http_url} admin={self.admin_address} "
                f"strategy={self.config.strategy.value} replicas=[{reps}] logs={self.log_dir}")

    def stop(self, timeout: float = 10.0) -> None:
        """Router first, then every replica process (ssh / srun / local)."""
        stop_procs([self.router] if self.router else [], self.replicas, timeout=timeout)


def _nodes(config: LaunchConfig) -> list[Node]:
    if config.slurm:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        if not nodelist:
            raise ValueError("--slurm but SLURM_JOB_NODELIST is not set (run inside an allocation)")
        return slurm_nodes(nodelist, config.slots)
    assert config.hosts is not None
    return parse_hosts(config.hosts.read_text())


def run(config: LaunchConfig) -> int:
    """Entry point of `pdcluster launch`: start, print the ready line, run until Ctrl-C / SIGTERM."""
    try:
        launch = Launch(config, _nodes(config))
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        print(f"pdcluster launch: {exc}", file=sys.stderr)
        return 2
    if config.dry_run:
        print(launch.dry_run(), flush=True)
        return 0
    return supervise("pdcluster launch", launch)
