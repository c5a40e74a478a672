"""`pdcluster launch FILE`: replicas on every node of a cluster file, the router here, one ready line.

```
 pdcluster launch FILE ─┬─ discover: `pdcluster devices --json --ports N …` on every node (bounded pool)
                        ├─ place replicas on what was found, rank table from the ports drawn there
                        ├─ stage the rank table on every node (stdin of one short session each)
                        ├─ one session per replica: ssh -tt NODE | srun --nodelist=NODE | bash -c
                        │     'echo $$ > PIDFILE; export CUDA_VISIBLE_DEVICES=…; exec pdcluster replica …'
                        ├─ wait for every replica's ready line (a progress line per node, one deadline)
                        └─ pdcluster router --replica … (here) ─► "pdcluster launch ready: …"
```
Then the supervisor keeps it up (`supervisor.py`: restarts, giving up when the allocation ended or
no node answers). `LOG_DIR/run.json` records the run for `pdcluster status` and `down`; every
replica's output (its log) streams back over its session into `LOG_DIR/RUN_ID/NODE/`.
Stopping: the router, then each node's replicas by their pid files (SIGTERM, SIGKILL after 15 s),
then the sessions. The pure half (placement, rank table, commands) is `launch_plan.py`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.clusterfile import (
    ClusterFile,
    ClusterFileError,
    DeviceMode,
    Fabric,
    NodeSpec,
    Via,
    parse,
)
from pdcluster.cluster.launch_plan import Commands, Placement, place, rank_table, router_args, wrap
from pdcluster.cluster.processes import (
    REPLICA_READY,
    ROUTER_READY,
    Proc,
    parse_router_ready,
    pdcluster_argv,
    spawn,
    stop_procs,
)
from pdcluster.cluster.remote import SSH_FAILED, Answer, fan_out
from pdcluster.cluster.runstate import (
    ReplicaRecord,
    RunFile,
    RunPhase,
    RunRecord,
    launcher_alive,
    this_launcher,
)
from pdcluster.cluster.supervisor import RestartPolicy, supervise
from pdcluster.discovery.checks import port_problem
from pdcluster.discovery.inventory import Inventory

PROBE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class LaunchConfig:
    """Flags of `pdcluster launch`."""

    file: Path = field(metadata={"help": "cluster file (TOML; see pdcluster/cluster/README.md)", "positional": True})
    via: str = field(default="", metadata={"help": "how replicas reach their nodes; empty = the file's launch.via",
                                           "choices": ["", "ssh", "slurm", "local"]})
    fabric: str = field(default="", metadata={"help": "transfer fabric; empty = the file's launch.fabric",
                                              "choices": ["", "tcp", "nccl", "rdma"]})
    dry_run: bool = field(default=False, metadata={"help": (
        "discover every node, print the placement, rank table and commands; start nothing")})

    def __post_init__(self) -> None:
        self.file = Path(self.file)


class LaunchError(RuntimeError):
    """The launch cannot go on; the message names the node and the cause."""


def pdcluster_command(configured: str) -> list[str]:
    """The pdcluster command line on the nodes: the configured one, else this venv's."""
    if configured:
        return shlex.split(configured)
    script = Path(sys.executable).parent / "pdcluster"
    return [str(script)] if script.exists() else pdcluster_argv()


def load(config: LaunchConfig) -> tuple[ClusterFile, Via]:
    """The cluster file with the command line's overrides applied (ClusterFileError when unusable)."""
    cluster = parse(config.file)
    if config.fabric:
        cluster = _with_fabric(cluster, Fabric(config.fabric))
    return cluster, Via(config.via) if config.via else cluster.launch.via


def _with_fabric(cluster: ClusterFile, fabric: Fabric) -> ClusterFile:
    for node in cluster.nodes:
        if fabric is Fabric.NCCL and node.devices.mode is DeviceMode.CPU:
            raise ClusterFileError(f"--fabric {fabric.value} needs CUDA devices but {node.name} has devices = "
                                   f"\"cpu\" in {cluster.path}")
    return replace(cluster, launch=replace(cluster.launch, fabric=fabric))


class Launch:
    """Discover, place, start, watch and stop one multi-node cluster."""

    def __init__(self, cluster: ClusterFile, via: Via, run_id: str = "") -> None:
        self.cluster = cluster
        self.via = via
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.run_dir = cluster.launch.log_dir / self.run_id
        workdir = cluster.launch.workdir or SOURCE_ROOT
        self.commands = Commands(cluster, self.run_id, tuple(pdcluster_command(cluster.launch.pdcluster)),
                                 PurePosixPath(workdir))
        self.policy = RestartPolicy(cluster.launch.max_restarts, cluster.launch.restart_window_s)
        self.slurm_job = os.environ.get("SLURM_JOB_ID", "") if via is Via.SLURM else ""
        self.run_file = RunFile(cluster.launch.log_dir)
        self.placements: list[Placement] = []
        self.replicas: list[Proc] = []
        self.router: Proc | None = None
        self.http_url = ""
        self.admin_address = ""
        self.staged: list[NodeSpec] = []
        self.started_at = time.monotonic()
        self.failure = ""
        self.allocation_gone = False
        self.claimed = False  # run.json is this launch's (never overwrite another live launch's record)  # Slurm ended the steps already; no srun can reach the nodes now

    # --- sessions ---------------------------------------------------------------------------------
    def argv(self, node: NodeSpec, script: str, tty: bool = False, name: str = "") -> list[str]:
        """How `script` runs on `node` by this launch's way of reaching nodes."""
        return wrap(self.via, self.cluster, node, script, tty, name)

    def _fan_out(self, nodes: list[NodeSpec], script_of: Callable[[NodeSpec], str], timeout: float,
                 stdin: str | None = None) -> list[Answer]:
        return fan_out(nodes, lambda n: self.argv(n, script_of(n)), timeout, self.cluster.launch.fanout, stdin)

    # --- start ------------------------------------------------------------------------------------
    def discover(self, deadline: float) -> dict[int, Inventory]:
        """Every node's inventory (LaunchError naming the first node that did not answer)."""
        timeout = max(1.0, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
        answers = self._fan_out(list(self.cluster.nodes), self.commands.probe_script, timeout)
        inventories = {}
        for answer in answers:
            node = answer.node
            if not answer.ok:
                raise LaunchError(f"node {node.name} ({node.address}): discovery failed: {answer.why(self.via)}")
            inventory = _inventory(answer)
            if inventory is None:
                raise LaunchError(f"node {node.name} ({node.address}): `pdcluster devices` printed no inventory: "
                                  f"{(answer.err or answer.out).strip()[-300:]}")
            inventories[node.index] = inventory
            _progress(f"node {node.name} ({node.address}): {_describe(inventory)}, answered in "
                      f"{answer.seconds:.1f} s")
        return inventories

    def plan(self, inventories: dict[int, Inventory]) -> None:
        """Place every replica (ClusterFileError naming the line when a node cannot take its share)."""
        self.placements = place(self.cluster, inventories)

    def stage(self, deadline: float) -> None:
        """Write the rank table on every node that runs a replica."""
        nodes = _unique(p.node for p in self.placements)
        table = rank_table(self.placements).to_json()
        self.staged = nodes
        timeout = max(1.0, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
        for answer in self._fan_out(nodes, lambda _: self.commands.stage_script(), timeout, stdin=table):
            if not answer.ok:
                raise LaunchError(f"node {answer.node.name} ({answer.node.address}): cannot store the rank table: "
                                  f"{answer.why(self.via)}")

    def start_replicas(self) -> None:
        """One session per replica; its output streams into the run's log folder."""
        for p in self.placements:
            log = self.run_dir / p.node.name / f"{p.name}.log"
            argv = self.argv(p.node, self.commands.replica_script(p), tty=True, name=f"pdcluster-r{p.rank}")
            self.replicas.append(spawn(p.name, p.role, argv, log, ready_prefix=REPLICA_READY, node=p.node.name))

    def wait_ready(self, deadline: float) -> None:
        """Until every replica printed its ready line: one progress line per node as it completes."""
        nodes = _unique(p.node for p in self.placements)
        pending = {n.name: [r for r in self.replicas if r.node == n.name] for n in nodes}
        while pending:
            for name, procs in list(pending.items()):
                for proc in procs:
                    if not proc.ready and proc.returncode is not None:
                        raise self._node_failed(proc, proc.exit_message(proc.returncode))
                if all(proc.ready for proc in procs):
                    del pending[name]
                    _progress(f"node {name}: {len(procs)}/{len(procs)} replica(s) serving after "
                              f"{time.monotonic() - self.started_at:.1f} s")
            if pending and time.monotonic() > deadline:
                name, procs = next(iter(pending.items()))
                late = next(p for p in procs if not p.ready)
                raise self._node_failed(late, f"{late.where} printed no ready line within "
                                              f"{self.cluster.launch.ready_timeout_s:g} s (log: {late.log})")
            time.sleep(0.1)
        for proc, p in zip(self.replicas, self.placements, strict=True):
            proc.address = proc.ready_line[len(REPLICA_READY):].strip() or p.address

    def _node_failed(self, proc: Proc, message: str) -> LaunchError:
        tail = "\n".join(f"    {line}" for line in proc.tail(6))
        node = next(p.node for p in self.placements if p.name == proc.name)
        return LaunchError(f"node {node.name} ({node.address}) failed to start: {message}"
                           + (f"\n  its log ends:\n{tail}" if tail else ""))

    def start_router(self, deadline: float) -> None:
        """The router here, over every started replica."""
        args = router_args(self.cluster, self.placements)
        self.router = spawn("router", "router", pdcluster_argv(*args), self.run_dir / "router.log",
                            ready_prefix=ROUTER_READY)
        line = self.router.wait_ready(deadline)
        self.http_url, self.admin_address = parse_router_ready(line)

    def start(self) -> None:
        """Discover, place, stage, start every replica, wait for them, then the router."""
        self._claim()
        deadline = self.started_at + self.cluster.launch.ready_timeout_s
        _check_router_ports(self.cluster)
        self.plan(self.discover(deadline))
        self._record(RunPhase.STARTING)
        self.stage(deadline)
        self.start_replicas()
        self.wait_ready(deadline)
        self.start_router(deadline)
        self._record(RunPhase.READY)

    def _claim(self) -> None:
        """Refuse to start over a run of the same file that is still up."""
        old = self.run_file.read() if self.run_file.path.exists() else None
        if old is not None and launcher_alive(old) and old.phase in (RunPhase.STARTING.value, RunPhase.READY.value):
            raise LaunchError(f"{self.cluster.path} is already launched (run {old.run_id}, pid {old.launcher_pid}); "
                              f"`pdcluster down {self.cluster.path}` stops it")
        self.claimed = True
        self._record(RunPhase.STARTING)

    def ready_line(self) -> str:
        """The one line `pdcluster launch` prints once everything serves."""
        reps = " ".join(f"{p.role}@{r.address}" for p, r in zip(self.placements, self.replicas, strict=True))
        return (f"pdcluster launch ready: http={self.http_url} admin={self.admin_address} "
                f"strategy={self.cluster.router.strategy.value} replicas=[{reps}] logs={self.run_dir}")

    # --- while serving ----------------------------------------------------------------------------
    def lost(self) -> str:
        """Why the cluster cannot come back ("" while it can)."""
        if self.via is Via.SLURM and self.slurm_job:
            state = slurm_job_state(self.slurm_job)
            if state is not None and state != "RUNNING":
                self.allocation_gone = True
                return f"the Slurm allocation {self.slurm_job} ended ({state or 'no longer known to Slurm'})"
        if self.via is Via.SSH and self.replicas and all(
                not r.running and r.exits and r.exits[-1] == SSH_FAILED for r in self.replicas):
            return "every node is unreachable (ssh exited with 255 for every replica)"
        return ""

    def changed(self) -> None:
        """Record every replica's state for `pdcluster status`."""
        self._record(RunPhase.READY if self.router is not None else RunPhase.STARTING)

    def failed(self, message: str) -> None:
        """Keep why the run failed (recorded when it stops)."""
        self.failure = message

    # --- stop -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """The router, then each node's replicas (pid files), then the sessions; record the end."""
        self._record(RunPhase.STOPPING)
        stop_procs([self.router] if self.router else [], timeout=10)
        if self.staged and not self.allocation_gone:
            for answer in self._fan_out(self.staged, lambda _: self.commands.stop_script(), STOP_TIMEOUT_S):
                if not answer.ok:
                    _progress(f"node {answer.node.name}: stopping its replicas failed: {answer.why(self.via)}")
        stop_procs(self.replicas, timeout=10)
        self._record(RunPhase.FAILED if self.failure else RunPhase.STOPPED)

    def _record(self, phase: RunPhase) -> None:
        if not self.claimed:
            return
        replicas = tuple(
            ReplicaRecord(p.rank, p.role, p.node.name, p.address, p.device, p.nic, str(r.log), _state(r),
                          len(r.restarts))
            for p, r in zip(self.placements, self.replicas, strict=False))
        if not replicas:
            replicas = tuple(ReplicaRecord(p.rank, p.role, p.node.name, p.address, p.device, p.nic, "", "planned")
                             for p in self.placements)
        self.run_file.write(RunRecord(
            run_id=self.run_id, cluster_file=str(self.cluster.path.resolve()), via=self.via.value,
            node_dir=str(self.commands.node_dir), slurm_job=self.slurm_job, phase=phase.value,
            http=self.http_url, admin=self.admin_address, admin_token_set=bool(self.cluster.router.admin_token),
            replicas=replicas, nodes=tuple(n.name for n in self.staged), logs=str(self.run_dir),
            message=self.failure, **this_launcher()))

    def dry_run(self) -> str:
        """The placement, rank table and every command, as text (after discovery)."""
        self.plan(self.discover(time.monotonic() + self.cluster.launch.ready_timeout_s))
        lines = ["# placement", *(f"rank {p.rank} {p.role} on {p.node.name}: {p.device} nic={p.nic or '-'} "
                                  f"grpc={p.address} transfer={p.node.transfer_host}:{p.transfer_port}"
                                  + (f" cores={','.join(map(str, p.engine_cpus))}" if p.engine_cpus else "")
                                  for p in self.placements)]
        lines += ["# rank table", rank_table(self.placements).to_json()]
        lines += [f"# rank {p.rank} ({p.role}) on {p.node.name}\n"
                  f"{shlex.join(self.argv(p.node, self.commands.replica_script(p), True, f'pdcluster-r{p.rank}'))}"
                  for p in self.placements]
        return "\n".join([*lines, "# router (here)",
                          shlex.join(["pdcluster", *router_args(self.cluster, self.placements)])])


def _state(proc: Proc) -> str:
    code = proc.returncode
    if code is not None:
        return f"exited {code}"
    return "serving" if proc.ready else ("restarting" if proc.restarts else "starting")


def _unique(nodes: Iterable[NodeSpec]) -> list[NodeSpec]:
    """The nodes in order of first appearance."""
    seen: dict[int, NodeSpec] = {}
    for node in nodes:
        seen.setdefault(node.index, node)
    return list(seen.values())


def _inventory(answer: Answer) -> Inventory | None:
    for line in reversed(answer.out.splitlines()):
        if line.strip().startswith("{"):
            try:
                return Inventory.from_json(line.strip())
            except ValueError:
                return None
    return None


def _describe(inv: Inventory) -> str:
    devices = f"{len(inv.gpus)} CUDA device(s)" if inv.gpus else f"CPU only ({len(inv.cpus.cores)} cores)"
    nic = f", transfer NIC {inv.transfer_nic}" if inv.transfer_nic else ""
    return f"host {inv.hostname}, {devices}{nic}"


def _progress(text: str) -> None:
    print(f"pdcluster launch: {text}", file=sys.stderr, flush=True)


def _check_router_ports(cluster: ClusterFile) -> None:
    r = cluster.router
    for flag, port in (("http_port", r.http_port), ("admin_port", r.admin_port)):
        problem = port_problem(r.host, port)
        if problem:
            raise cluster.error(("router", flag), f"router.{flag}: {problem}")


def slurm_job_state(job: str) -> str | None:
    """The job's state ("RUNNING", "COMPLETING", …; "" when Slurm no longer knows it), None if unknown."""
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return "" if "Invalid job id" in done.stderr else None
    return done.stdout.strip()


def run(config: LaunchConfig) -> int:
    """Entry point of `pdcluster launch`: start, print the ready line, supervise until Ctrl-C / SIGTERM."""
    cluster, via = load(config)
    if via is Via.SLURM and not os.environ.get("SLURM_JOB_ID"):
        raise LaunchError("--via slurm runs inside an allocation (salloc / sbatch): SLURM_JOB_ID is not set")
    launch = Launch(cluster, via)
    if config.dry_run:
        print(launch.dry_run(), flush=True)
        return 0
    return supervise("pdcluster launch", launch)
