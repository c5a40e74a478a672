"""`pdcluster launch FILE`: replicas on every node of a cluster file, the router here, one ready line.

```
 pdcluster launch FILE ─┬─ with --wheelhouse DIR: its tar to every node, pip install --no-index there
                        ├─ discover: `pdcluster devices --json --ports N …` on every node (bounded pool)
                        ├─ place replicas on what was found, rank table from the ports drawn there
                        ├─ nccl / rdma / auto: serve the rendezvous store here, its address in the table
                        ├─ stage the rank table on every node (stdin of one short session each), with
                        │     [tls] / a token: the node's certificate and key, the CA, the token file
                        │     (security.py)
                        ├─ one session per replica: ssh -tt NODE | srun --nodelist=NODE | bash -c
                        │     'echo $$ > PIDFILE; export CUDA_VISIBLE_DEVICES=N; exec pdcluster replica
                        │      … --device cuda --gpu-memory-fraction F' (CPU workers: --device cpu;
                        │      cuda-ipc / auto: the node's devices N,M,… and --device cuda:K)
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
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.clusterfile import ClusterFile, Fabric, LaunchDevice, NodeSpec, Via, parse, with_launch
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
from pdcluster.cluster.security import bundle
from pdcluster.cluster.supervisor import RestartPolicy, supervise
from pdcluster.cluster.wheelhouse import read_manifest
from pdcluster.discovery.checks import port_problem
from pdcluster.discovery.inventory import Inventory
from transfer.fabric import FABRIC_CHOICES, needs_store

PROBE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class LaunchConfig:
    """Flags of `pdcluster launch`."""

    file: Path = field(metadata={"help": "cluster file (TOML; see pdcluster/cluster/README.md)",
                                 "positional": True})
    via: str = field(default="", metadata={"help": "how replicas reach their nodes; empty = launch.via",
                                           "choices": ["", "ssh", "slurm", "local"]})
    fabric: str = field(default="", metadata={"help": (
        "transfer fabric; empty = launch.fabric (for nccl, rdma and auto this process serves the "
        "rendezvous store, named in the rank table)"), "choices": ["", *FABRIC_CHOICES]})
    dry_run: bool = field(default=False, metadata={"help": (
        "discover every node, print the placement, rank table and commands; start nothing")})
    device: str = field(default="", metadata={"help": (
        "what the replicas run on; empty = launch.device (auto: each node's devices; cpu: CPU workers "
        "everywhere; cuda: a CUDA device for every replica)"), "choices": ["", "auto", "cpu", "cuda"]})
    gpu_memory_fraction: float = field(default=0.0, metadata={"help": (
        "the share of its GPU each CUDA replica may take; 0 = the cluster file's (default 0.9)")})
    wheelhouse: Path | None = field(default=None, metadata={"help": (
        "a `pdcluster wheelhouse` folder: copied to every node and installed there (pip --no-index) "
        "before discovery; unset = launch.wheelhouse")})
    tp: int = field(default=0, metadata={"help": (
        "ranks of every replica's tensor-parallel group (consecutive CUDA devices of one node, or "
        "slices of a CPU worker's cores) of nodes without a tp of their own; 0 = launch.tp")})

    def __post_init__(self) -> None:
        self.file = Path(self.file)
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.wheelhouse is not None:
            self.wheelhouse = Path(self.wheelhouse)
        if self.tp < 0:
            raise ValueError(f"--tp must be >= 1 (0 = the cluster file's), got {self.tp}")


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
    changes: dict[str, object] = {}
    if config.fabric:
        changes["fabric"] = Fabric(config.fabric)
    if config.device:
        changes["device"] = LaunchDevice(config.device)
    if config.gpu_memory_fraction:
        changes["gpu_memory_fraction"] = config.gpu_memory_fraction
    if config.wheelhouse is not None:
        changes["wheelhouse"] = config.wheelhouse.resolve()
    if config.tp:
        changes["tp"] = config.tp
    if changes:
        cluster = with_launch(cluster, **changes)
    check_tp_cuts(cluster)
    if cluster.launch.wheelhouse is not None:
        read_manifest(cluster.launch.wheelhouse)  # not a wheelhouse: refused before anything starts
    return cluster, Via(config.via) if config.via else cluster.launch.via


def check_tp_cuts(cluster: ClusterFile) -> None:
    """Every `tp` of the file cuts the checkpoint's heads, MLP and vocabulary evenly, checked on its
    config.json here (the router reads the checkpoint here too) before any node is reached; a
    checkpoint missing here is left to the nodes' discovery to name."""
    from replica.model.config import ModelConfig, UnsupportedModel
    from replica.model.layout import Shard, WeightLayout

    path = cluster.model.path
    for node in cluster.nodes:
        tp = cluster.tp_of(node)
        if tp == 1 or not (path / "config.json").is_file():
            continue
        try:
            WeightLayout.for_config(ModelConfig.from_dir(path), "float32", Shard(0, tp))
        except UnsupportedModel as exc:
            raise cluster.error(cluster.tp_where(node), f"tp {tp} on {node.name}: {exc}") from None


class Launch:
    """Discover, place, start, watch and stop one multi-node cluster."""

    def __init__(self, cluster: ClusterFile, via: Via, run_id: str = "") -> None:
        self.cluster = cluster
        self.via = via
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.run_dir = cluster.launch.log_dir / self.run_id
        command = tuple(pdcluster_command(cluster.launch.pdcluster))
        self.commands = Commands(cluster, self.run_id, command,
                                 PurePosixPath(cluster.launch.workdir or SOURCE_ROOT))
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
        self.allocation_gone = False  # Slurm ended the steps already: no srun reaches the nodes now
        self.claimed = False  # run.json is this launch's (another live launch's record is never overwritten)
        self.store: object | None = None  # the rendezvous store (a TCPStore) for nccl/rdma/auto
        self.store_address = ""

    # --- sessions ---------------------------------------------------------------------------------
    def argv(self, node: NodeSpec, script: str, tty: bool = False, name: str = "") -> list[str]:
        """How `script` runs on `node` by this launch's way of reaching nodes."""
        return wrap(self.via, self.cluster, node, script, tty, name)

    def _fan_out(self, nodes: list[NodeSpec], script_of: Callable[[NodeSpec], str], timeout: float,
                 stdin_of: Callable[[NodeSpec], str | Path] | None = None) -> list[Answer]:
        fanout = self.cluster.launch.fanout
        return fan_out(nodes, lambda n: self.argv(n, script_of(n)), timeout, fanout, stdin_of)

    def _timeout(self, deadline: float) -> float:
        return max(1.0, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))

    # --- start ------------------------------------------------------------------------------------
    def install(self, deadline: float) -> None:
        """With a wheelhouse: copy it to every node (a tar on the stdin of one session each, streamed
        from disk) and install pdcluster from it there, before discovery runs `pdcluster devices`."""
        folder = self.cluster.launch.wheelhouse
        if folder is None:
            return
        script = self._wheelhouse_script(folder)
        packed = self.run_dir / "wheelhouse.tar"
        pack_tar(folder, packed)
        nodes = list(self.cluster.nodes)
        for answer in self._fan_out(nodes, script, max(1.0, deadline - time.monotonic()),
                                    stdin_of=lambda _: packed):
            if not answer.ok:
                raise LaunchError(f"{_node(answer.node)}: installing the wheelhouse {folder} failed: "
                                  f"{answer.why(self.via)}")
            _progress(f"{_node(answer.node)}: pdcluster installed from the wheelhouse in "
                      f"{answer.seconds:.1f} s")
        packed.unlink(missing_ok=True)

    def _wheelhouse_script(self, folder: Path) -> Callable[[NodeSpec], str]:
        record = read_manifest(folder)
        return lambda node: self.commands.wheelhouse_script(node, record.project, list(record.extras))

    def discover(self, deadline: float) -> dict[int, Inventory]:
        """Every node's inventory (LaunchError naming the first node that did not answer)."""
        answers = self._fan_out(list(self.cluster.nodes), self.commands.probe_script, self._timeout(deadline))
        inventories = {}
        for answer in answers:
            node = answer.node
            if not answer.ok:
                raise LaunchError(f"{_node(node)}: discovery failed: {answer.why(self.via)}")
            inventory = _inventory(answer)
            if inventory is None:
                said = (answer.err or answer.out).strip()[-300:]
                raise LaunchError(f"{_node(node)}: `pdcluster devices` printed no inventory: {said}")
            inventories[node.index] = inventory
            _progress(f"{_node(node)}: {_describe(inventory)}, answered in {answer.seconds:.1f} s")
        return inventories

    def plan(self, inventories: dict[int, Inventory]) -> None:
        """Place every replica (ClusterFileError naming the line when a node cannot take its share)."""
        self.placements = place(self.cluster, inventories)

    def stage(self, deadline: float) -> None:
        """Write the rank table (and the node's TLS files and the token) on every node that runs a replica."""
        self.staged = _unique(p.node for p in self.placements)
        table = rank_table(self.placements, self.serve_rendezvous()).to_json().encode()
        stage = self.commands.stage_script()

        def files(node: NodeSpec) -> str:
            local = self.commands.staged_files(node)
            return bundle({"ranks.json": table, **{name: path.read_bytes() for name, path in local.items()}})

        for answer in self._fan_out(self.staged, lambda _: stage, self._timeout(deadline), stdin_of=files):
            if not answer.ok:
                why = answer.why(self.via)
                raise LaunchError(f"{_node(answer.node)}: cannot store the rank table and its files: {why}")

    def serve_rendezvous(self) -> str:
        """The rendezvous store's "HOST:PORT" ("" when the fabric needs none): served in this process,
        which outlives every replica restart (a restarted replica re-joins as its next incarnation),
        on this machine's address on the route to the first node."""
        if not needs_store(self.cluster.launch.fabric.value) or not self.placements:
            return ""
        if self.store is None:
            try:
                from transfer.store import serve_store

                self.store, self.store_address = serve_store(store_host(self.placements[0].node.address))
            except (ImportError, RuntimeError, OSError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise LaunchError(f"fabric {self.cluster.launch.fabric.value} needs the rendezvous store "
                                  f"this process serves (torch.distributed.TCPStore): {first}") from exc
            _progress(f"rendezvous store on {self.store_address} (fabric {self.cluster.launch.fabric.value})")
        return self.store_address

    def start_replicas(self) -> None:
        """One session per replica; its output streams into the run's log folder."""
        for p in self.placements:
            log = self.run_dir / p.node.name / f"{p.name}.log"
            argv = self.argv(p.node, self.commands.replica_script(p), tty=True, name=f"pdcluster-r{p.rank}")
            proc = spawn(p.name, p.role, argv, log, ready_prefix=REPLICA_READY, node=p.node.name)
            self.replicas.append(proc)

    def wait_ready(self, deadline: float) -> None:
        """Until every replica printed its ready line: one progress line per node as it completes."""
        pending = {n.name: [r for r in self.replicas if r.node == n.name]
                   for n in _unique(p.node for p in self.placements)}
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
                late = next(p for procs in pending.values() for p in procs if not p.ready)
                raise self._node_failed(late, f"{late.where} printed no ready line within "
                                              f"{self.cluster.launch.ready_timeout_s:g} s (log: {late.log})")
            time.sleep(0.1)
        for proc, p in zip(self.replicas, self.placements, strict=True):
            proc.address = proc.ready_line[len(REPLICA_READY):].strip() or p.address

    def _node_failed(self, proc: Proc, message: str) -> LaunchError:
        tail = "\n".join(f"    {line}" for line in proc.tail(6))
        node = next(p.node for p in self.placements if p.name == proc.name)
        return LaunchError(f"{_node(node)} failed to start: {message}"
                           + (f"\n  its log ends:\n{tail}" if tail else ""))

    def start_router(self, deadline: float) -> None:
        """The router here, over every started replica."""
        args = router_args(self.cluster, self.placements)
        self.router = spawn("router", "router", pdcluster_argv(*args), self.run_dir / "router.log",
                            ready_prefix=ROUTER_READY)
        self.http_url, self.admin_address = parse_router_ready(self.router.wait_ready(deadline))

    def start(self) -> None:
        """Discover, place, stage, start every replica, wait for them, then the router."""
        self._claim()
        deadline = self.started_at + self.cluster.launch.ready_timeout_s
        _check_router_ports(self.cluster)
        self.install(deadline)
        self.plan(self.discover(deadline))
        self._record(RunPhase.STARTING)
        self.stage(deadline)
        self.start_replicas()
        self.wait_ready(deadline)
        self.start_router(deadline)
        self._record(RunPhase.READY)

    def _claim(self) -> None:
        """Refuse to start over a run of the same file that is still up."""
        old = self.run_file.read()
        live = (RunPhase.STARTING.value, RunPhase.READY.value)
        if old is not None and old.phase in live and launcher_alive(old):
            raise LaunchError(f"{self.cluster.path} is already launched (run {old.run_id}, pid "
                              f"{old.launcher_pid}); `pdcluster down {self.cluster.path}` stops it")
        self.claimed = True
        self._record(RunPhase.STARTING)

    def ready_line(self) -> str:
        """The one line `pdcluster launch` prints once everything serves."""
        reps = " ".join(f"{p.role}@{r.address}" for p, r in zip(self.placements, self.replicas, strict=True))
        router = self.cluster.router
        return (f"pdcluster launch ready: http={self.http_url} admin={self.admin_address} "
                f"strategy={router.strategy} scaling={router.scaling} replicas=[{reps}] logs={self.run_dir}")

    # --- while serving ----------------------------------------------------------------------------
    def lost(self) -> str:
        """Why the cluster cannot come back ("" while it can)."""
        if self.via is Via.SLURM and self.slurm_job:
            state = slurm_job_state(self.slurm_job)
            if state is not None and state != "RUNNING":
                self.allocation_gone = True
                return f"the Slurm allocation {self.slurm_job} ended ({state or 'no longer known to Slurm'})"
        unreachable = [not r.running and r.exits and r.exits[-1] == SSH_FAILED for r in self.replicas]
        if self.via is Via.SSH and self.replicas and all(unreachable):
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
            stop = self.commands.stop_script()
            for answer in self._fan_out(self.staged, lambda _: stop, STOP_TIMEOUT_S):
                if not answer.ok:
                    _progress(f"{_node(answer.node)}: stopping its replicas failed: {answer.why(self.via)}")
        stop_procs(self.replicas, timeout=10)
        self.store = None  # the replicas are gone: the rendezvous store goes with the launch
        self._record(RunPhase.FAILED if self.failure else RunPhase.STOPPED)

    def _record(self, phase: RunPhase) -> None:
        if self.claimed:
            self.run_file.write(self.record(phase))

    def record(self, phase: RunPhase) -> RunRecord:
        """This run as `run.json` holds it."""
        return RunRecord(
            run_id=self.run_id, cluster_file=str(self.cluster.path.resolve()), via=self.via.value,
            node_dir=str(self.commands.node_dir), slurm_job=self.slurm_job, phase=phase.value,
            http=self.http_url, admin=self.admin_address,
            admin_token_set=bool(self.cluster.router.admin_token), replicas=self._replica_records(),
            nodes=tuple(n.name for n in self.staged), logs=str(self.run_dir), message=self.failure,
            fabric=self.cluster.launch.fabric.value, store=self.store_address, **this_launcher())

    def _replica_records(self) -> tuple[ReplicaRecord, ...]:
        procs: list[Proc | None] = [*self.replicas] or [None] * len(self.placements)
        return tuple(ReplicaRecord(p.rank, p.role, p.node.name, p.address, p.device_label, p.nic,
                                   str(r.log) if r else "", _state(r), len(r.restarts) if r else 0)
                     for p, r in zip(self.placements, procs, strict=True))

    def dry_run(self) -> str:
        """The placement, rank table and every command, as text (after discovery; a wheelhouse is not
        installed: its command is shown, and discovery needs pdcluster on the nodes already)."""
        lines = []
        if self.cluster.launch.wheelhouse is not None:
            script = self._wheelhouse_script(self.cluster.launch.wheelhouse)
            for node in self.cluster.nodes:
                argv = self.argv(node, script(node))
                lines += [f"# wheelhouse on {node.name} (its tar on stdin)", shlex.join(argv)]
        self.plan(self.discover(time.monotonic() + self.cluster.launch.ready_timeout_s))
        lines += ["# placement", *map(_describe_placement, self.placements),
                 "# rank table", rank_table(self.placements).to_json()]
        if needs_store(self.cluster.launch.fabric.value) and self.placements:
            host = store_host(self.placements[0].node.address)
            lines += [f'# rendezvous store: served by this process at start on {host}:<a free port>, named '
                      'in the table\'s "store"']
        for p in self.placements:
            argv = self.argv(p.node, self.commands.replica_script(p), True, f"pdcluster-r{p.rank}")
            lines += [f"# rank {p.rank} ({p.role}) on {p.node.name}", shlex.join(argv)]
        router = shlex.join(["pdcluster", *router_args(self.cluster, self.placements)])
        return "\n".join([*lines, "# router (here)", router])


def pack_tar(folder: Path, out: Path) -> Path:
    """The wheels and the manifest of a wheelhouse as one uncompressed tar (wheels are zips already)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.suffix == ".whl" or path.name == "manifest.json"):
                tar.add(path, arcname=path.name)
    return out


def _state(proc: Proc | None) -> str:
    if proc is None:
        return "planned"
    code = proc.returncode
    if code is not None:
        return f"exited {code}"
    return "serving" if proc.ready else ("restarting" if proc.restarts else "starting")


def _node(node: NodeSpec) -> str:
    return f"node {node.name} ({node.address})"


def _unique(nodes: Iterable[NodeSpec]) -> list[NodeSpec]:
    """The nodes in order of first appearance."""
    seen: dict[int, NodeSpec] = {}
    for node in nodes:
        seen.setdefault(node.index, node)
    return list(seen.values())


def _inventory(answer: Answer) -> Inventory | None:
    """The inventory a node printed (its last JSON line: a login shell may print other lines first)."""
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


def _describe_placement(p: Placement) -> str:
    cores = f" cores={','.join(map(str, p.engine_cpus))}" if p.engine_cpus else ""
    group = f" tp={p.tp} ranks={p.rank}-{p.rank + p.tp - 1}" if p.tp > 1 else ""
    return (f"rank {p.rank} {p.role} on {p.node.name}: {p.device_label} nic={p.nic or '-'} grpc={p.address} "
            f"transfer={p.node.transfer_host}:{p.transfer_port}{group}{cores}")


def _progress(text: str) -> None:
    print(f"pdcluster launch: {text}", file=sys.stderr, flush=True)


def store_host(towards: str) -> str:
    """This machine's address on the route to the node at `towards` (the local end of a UDP socket
    connected there: nothing is sent); the host name where there is no such route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((towards, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _check_router_ports(cluster: ClusterFile) -> None:
    r = cluster.router
    for key, port in (("http_port", r.http_port), ("admin_port", r.admin_port)):
        problem = port_problem(r.host, port)
        if problem:
            raise cluster.error(("router", key), f"router.{key}: {problem}")


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
