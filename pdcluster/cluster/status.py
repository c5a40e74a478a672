"""`pdcluster status FILE` and `pdcluster down FILE`, from another shell than the launch's.

```
 status ─ LOG_DIR/run.json ─┬─ launcher alive? (pid + start time)
                            ├─ each replica: grpc.health.v1 Check on its address (2 s)
                            └─ the router's view: router.v1.RouterAdmin/ListReplicas (role, requests)
          both over TLS when the file has [tls]: its CA, and its client certificate under mutual TLS
 down   ─ LOG_DIR/run.json ─┬─ SIGTERM the launcher, wait for it (it stops the router, then the replicas)
                            └─ then on every node: the run's stop script (pid files; only this run's
                               processes), in case the launcher was killed before it could
```
"""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster.cluster.clusterfile import ClusterFile, NodeSpec, Via, parse
from pdcluster.cluster.launch_plan import Commands, wrap
from pdcluster.cluster.remote import fan_out
from pdcluster.cluster.runstate import RunFile, RunPhase, RunRecord, launcher_alive
from pdcluster.cluster.security import CA_NAME
from protos import router_pb2, router_pb2_grpc

NOT_RUNNING = 3  # `status` exit code when no launch of the file runs (as `systemctl status` has it)


@dataclass
class StatusConfig:
    """Flags of `pdcluster status`."""

    file: Path = field(metadata={"help": "cluster file the launch was started with", "positional": True})
    timeout: float = field(default=2.0, metadata={"help": "seconds each health check may take"})

    def __post_init__(self) -> None:
        self.file = Path(self.file)


@dataclass
class DownConfig:
    """Flags of `pdcluster down`."""

    file: Path = field(metadata={"help": "cluster file the launch was started with", "positional": True})
    timeout: float = field(default=60.0, metadata={"help": "seconds to wait for the launcher to stop"})

    def __post_init__(self) -> None:
        self.file = Path(self.file)


def _record(cluster: ClusterFile) -> RunRecord | None:
    return RunFile(cluster.launch.log_dir).read()


@dataclass(frozen=True)
class Tls:
    """How `status` reaches TLS servers: the CA (and client certificate) and the router's name."""

    credentials: grpc.ChannelCredentials
    router_name: str  # the name the router's certificate carries (its admin address may be 0.0.0.0)


def tls_of(cluster: ClusterFile) -> Tls | None:
    """`[tls]` of the file as client credentials; None without TLS."""
    sec = cluster.security
    if not sec.tls:
        return None
    pair = (sec.local(f"{sec.client}.key").read_bytes(), sec.local(f"{sec.client}.crt").read_bytes()) \
        if sec.mutual else (None, None)
    credentials = grpc.ssl_channel_credentials(sec.local(CA_NAME).read_bytes(), *pair)
    return Tls(credentials, sec.router_name or cluster.router.host)


def channel(address: str, tls: Tls | None, name: str = "") -> grpc.Channel:
    """A channel to `address`; over TLS when `tls`, checking the certificate names `name` if given."""
    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, tls.credentials, options)


def health(address: str, timeout: float, tls: Tls | None = None) -> str:
    """SERVING / NOT_SERVING (still loading) / UNREACHABLE: the replica's grpc.health.v1 answer."""
    with channel(address, tls) as channel_:
        try:
            stub = health_pb2_grpc.HealthStub(channel_)
            answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def router_view(admin: str, timeout: float, tls: Tls | None = None) -> dict[str, str]:
    """Replica address -> its role as the router sees it ({} when the router does not answer)."""
    with channel(admin, tls, tls.router_name if tls else "") as channel_:
        try:
            answer = router_pb2_grpc.RouterAdminStub(channel_).ListReplicas(
                router_pb2.ListReplicasRequest(), timeout=timeout)
        except grpc.RpcError:
            return {}
    return {r.address: router_pb2.ReplicaRole.Name(r.role).removeprefix("REPLICA_ROLE_").lower()
            for r in answer.replicas}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def run_status(config: StatusConfig) -> int:
    """Entry point of `pdcluster status`: 0 all serving, 1 something is not, 3 no launch running."""
    cluster = parse(config.file)
    record = _record(cluster)
    if record is None:
        print(f"{config.file}: never launched (no {cluster.launch.log_dir}/run.json)")
        return NOT_RUNNING
    alive = launcher_alive(record)
    print(f"run {record.run_id}: {record.phase}, launcher pid {record.launcher_pid} "
          f"{'running' if alive else 'not running'}, via {record.via}"
          + (f" (Slurm job {record.slurm_job})" if record.slurm_job else ""))
    if record.message:
        print(f"  {record.message.splitlines()[0]}")
    if not alive:
        return NOT_RUNNING
    tls = tls_of(cluster)
    view = router_view(record.admin, config.timeout, tls) if record.admin else {}
    print(f"router: http={record.http or '-'} admin={record.admin or '-'} "
          f"({'answering' if view else 'not answering'}); logs {record.logs}")
    if record.fabric:
        print(f"fabric: {record.fabric}" + (f" (rendezvous store {record.store})" if record.store else ""))
    with ThreadPoolExecutor(max_workers=16) as pool:
        states = list(pool.map(lambda r: health(r.address, config.timeout, tls), record.replicas))
    rows = [["RANK", "ROLE", "NODE", "ADDRESS", "DEVICE", "NIC", "HEALTH", "ROUTER", "LAUNCHER", "RESTARTS"]]
    rows += [[str(r.rank), r.role, r.node, r.address, r.device, r.nic or "-", state, view.get(r.address, "-"),
              r.state, str(r.restarts)] for r, state in zip(record.replicas, states, strict=True)]
    print(_table(rows))
    serving = record.phase == RunPhase.READY.value and all(s == "SERVING" for s in states)
    return 0 if serving else 1


def _nodes(cluster: ClusterFile, names: tuple[str, ...]) -> list[NodeSpec]:
    return [n for n in cluster.nodes if n.name in names]


def _wait_gone(record: RunRecord, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while launcher_alive(record):
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def sweep(cluster: ClusterFile, record: RunRecord) -> list[str]:
    """Run the stop script of `record`'s run on each of its nodes; one line per node that did something."""
    nodes = _nodes(cluster, record.nodes)
    if not nodes:
        return []
    commands = Commands(cluster, record.run_id, (), PurePosixPath("/"))
    script = commands.stop_script()

    def argv(node: NodeSpec) -> list[str]:
        line = wrap(Via(record.via), cluster, node, script)
        if record.via == Via.SLURM.value and record.slurm_job:  # from outside the allocation too
            line.insert(1, f"--jobid={record.slurm_job}")
        return line

    report = []
    for answer in fan_out(nodes, argv, 60.0, cluster.launch.fanout):
        words = answer.out.split()
        if not answer.ok:
            report.append(f"{answer.node.name}: {answer.why(Via(record.via))}")
        elif any(w != "stopped:" and w != "killed:" for w in words):
            report.append(f"{answer.node.name}: {answer.out.strip()}")
    return report


def run_down(config: DownConfig) -> int:
    """Entry point of `pdcluster down`: stop the launch of FILE and everything it started (even when
    its certificate or token files are gone: it needs none of them)."""
    cluster = parse(config.file, files=False)
    record = _record(cluster)
    if record is None:
        print(f"{config.file}: nothing to stop (never launched)")
        return 0
    if launcher_alive(record):
        print(f"stopping run {record.run_id} (launcher pid {record.launcher_pid}) ...", flush=True)
        os.kill(record.launcher_pid, signal.SIGTERM)
        if not _wait_gone(record, config.timeout):
            print(f"launcher pid {record.launcher_pid} still runs after {config.timeout:g} s: SIGKILL",
                  file=sys.stderr)
            os.kill(record.launcher_pid, signal.SIGKILL)
            _wait_gone(record, 10)
    leftovers = sweep(cluster, record)
    for line in leftovers:
        print(f"  {line}")
    final = RunFile(cluster.launch.log_dir).read() or record
    if final.phase not in (RunPhase.STOPPED.value, RunPhase.FAILED.value):
        RunFile(cluster.launch.log_dir).write(final.with_(phase=RunPhase.STOPPED.value,
                                                          message="stopped by pdcluster down"))
    print(f"run {record.run_id} stopped: launcher, router and {len(record.replicas)} replica(s) on "
          f"{len(record.nodes)} node(s)" + (" (leftovers stopped above)" if leftovers else ""))
    return 0
