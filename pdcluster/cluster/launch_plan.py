"""The pure half of `pdcluster launch`: replicas placed on what discovery found, the rank table, and
every command line (probe, stage, replica, stop, router), for each way of reaching a node.

```
 ClusterFile + {node: Inventory} ──place()──► [Placement: rank, role, node, device, NIC, cores, ports]
                                             ──rank_table()──► RankTable (JSON, staged on every node)
 Placement ──replica_script()──► bash script ──wrap(via, node)──► ssh -tt … | srun … | bash -c …
```
A replica of `tp` N is a tensor-parallel group (`replica/tp`): rank 0 serves gRPC and starts the
others on the same node, so the group takes N consecutive CUDA devices of one node's list (or N
slices of one CPU worker's cores) and N consecutive global ranks of the rank table (`rank` ..
`rank + N - 1`, one entry per tp_rank, each with its own transfer port: the seeds' `src_ranks` /
`dst_ranks` name one rank per tp_rank).
Nothing here starts a process or reads the environment: every piece is unit-tested as data.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from pdcluster.cluster.clusterfile import (
    ClusterFile,
    DeviceMode,
    Fabric,
    LaunchDevice,
    NodeSpec,
    SshSpec,
    Via,
)
from pdcluster.cluster.extra_flags import flag_args
from pdcluster.discovery.inventory import Inventory
from transfer.ranktable import RankTable

AUTO_DEVICE_BOUND = 16  # ports drawn for a node whose device count only discovery knows


@dataclass(frozen=True)
class Placement:
    """One replica: its rank and role, where it runs, on what, and the two ports it listens on."""

    rank: int
    role: str
    node: NodeSpec
    device: str  # "cpu" or "cuda:N"
    port: int
    transfer_port: int
    engine_cpus: tuple[int, ...] = ()  # a CPU worker's own cores (cpu_replicas > 1)
    nic: str = ""
    rdma_device: str = ""
    numa_node: int | None = None
    shared_devices: tuple[int, ...] = ()  # the node's CUDA devices every replica there sees (cuda-ipc)
    group_ordinals: tuple[int, ...] = ()  # a CUDA tp group's devices, rank 0's first (() under tp 1)
    group_ports: tuple[int, ...] = ()  # transfer ports of a tp group's ranks 1 .. tp - 1

    @property
    def tp(self) -> int:
        """Ranks of its tensor-parallel group (global ranks `rank` .. `rank + tp - 1`)."""
        return 1 + len(self.group_ports)

    @property
    def rank_devices(self) -> tuple[str, ...]:
        """The device of each rank of its group, tp_rank order ("cpu": every rank a slice of the cores)."""
        if self.ordinal is None or not self.group_ordinals:
            return (self.device,) * self.tp
        return tuple(f"cuda:{o}" for o in self.group_ordinals)

    @property
    def device_label(self) -> str:
        """Its device(s) as `status` shows them: "cuda:0", "cuda:0,1" (a tp group), "cpu", "cpu/2"."""
        if self.tp == 1:
            return self.device
        if self.ordinal is None:
            return f"cpu/{self.tp}"
        return "cuda:" + ",".join(map(str, self.group_ordinals))

    @property
    def address(self) -> str:
        """gRPC address HOST:PORT."""
        return f"{self.node.address}:{self.port}"

    @property
    def ordinal(self) -> int | None:
        """The CUDA device's index on its node (as discovery lists it); None for a CPU worker."""
        return int(self.device.removeprefix("cuda:")) if self.device.startswith("cuda:") else None

    @property
    def cuda_visible_devices(self) -> str:
        """`CUDA_VISIBLE_DEVICES` of this replica: its one device, the node's devices it shares with
        the node's other replicas (`shared_devices`), or none for a CPU worker."""
        if self.ordinal is None:
            return ""
        return ",".join(map(str, self.shared_devices or self.group_ordinals or (self.ordinal,)))

    @property
    def torch_device(self) -> str:
        """`--device` of the replica: its device among the visible ones ("cpu" for a CPU worker)."""
        if self.ordinal is None:
            return "cpu"
        return f"cuda:{self.shared_devices.index(self.ordinal)}" if self.shared_devices else "cuda"

    @property
    def name(self) -> str:
        """"replica-R-ROLE", the name in logs and messages."""
        return f"replica-{self.rank}-{self.role}"


def ports_per_replica(tp: int) -> int:
    """Ports of one replica of `tp` ranks: its gRPC port and a transfer port per rank."""
    return 1 + tp


def ports_wanted(node: NodeSpec, tp: int = 1) -> int:
    """How many ports to draw on `node` (its replicas of `tp` ranks) before its device count is known."""
    if node.devices.mode is DeviceMode.LIST:
        slots = len(node.devices.ordinals)
    elif node.role and node.devices.mode is DeviceMode.AUTO:
        slots = max(AUTO_DEVICE_BOUND, node.cpu_replicas)
    else:
        slots = max(node.cpu_replicas, sum(n for _, n in node.counts))
    return ports_per_replica(tp) * slots


@dataclass(frozen=True)
class _Slot:
    device: str
    engine_cpus: tuple[int, ...]
    nic: str
    rdma_device: str
    numa_node: int | None
    ordinals: tuple[int, ...] = ()  # a CUDA tp group's devices, rank 0's first


def _gpu_slots(cluster: ClusterFile, node: NodeSpec, inv: Inventory) -> list[_Slot]:
    """One slot per tp group: consecutive devices of the node's list (discovery's order under auto)."""
    found = {g.index: g for g in inv.gpus}
    wanted = node.devices.ordinals if node.devices.mode is DeviceMode.LIST else tuple(sorted(found))
    missing = [o for o in wanted if o not in found]
    if missing:
        raise cluster.error(("nodes", node.index, "devices"),
                            f"{node.name} lists CUDA device {missing[0]} but discovery found "
                            f"{_found(inv)}")
    tp = cluster.tp_of(node)
    groups = [wanted[i:i + tp] for i in range(0, len(wanted) - tp + 1, tp)]
    return [_Slot(found[g[0]].device, (), found[g[0]].nic or inv.transfer_nic, found[g[0]].rdma_device,
                  found[g[0]].numa_node, g if tp > 1 else ()) for g in groups]


def _found(inv: Inventory) -> str:
    return f"{len(inv.gpus)} ({', '.join(str(g.index) for g in inv.gpus)})" if inv.gpus else "none"


def cpu_sets(cores: tuple[int, ...], numa: dict[int, tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    """`n` disjoint, equal-sized core sets, NUMA node by NUMA node (left-over cores are not used)."""
    if n > len(cores):
        raise ValueError(f"{n} CPU workers but only {len(cores)} cores")
    ordered = sorted(cores, key=lambda c: (next((k for k, v in numa.items() if c in v), -1), c))
    size = len(ordered) // n
    return [tuple(sorted(ordered[i * size:(i + 1) * size])) for i in range(n)]


def _cpu_slots(cluster: ClusterFile, node: NodeSpec, inv: Inventory) -> list[_Slot]:
    n = node.cpu_replicas
    _check_cpu_tp(cluster, node, len(inv.cpus.cores) // n)
    if n == 1:  # one worker: all the node's cores, no placement
        return [_Slot("cpu", (), inv.transfer_nic, "", _one_numa(inv, inv.cpus.cores))]
    try:
        sets = cpu_sets(inv.cpus.cores, inv.cpus.numa, n)
    except ValueError as exc:
        raise cluster.error(("nodes", node.index, "cpu_replicas"), f"{node.name}: {exc}") from None
    return [_Slot("cpu", cores, inv.transfer_nic, "", _one_numa(inv, cores)) for cores in sets]


def _check_cpu_tp(cluster: ClusterFile, node: NodeSpec, cores: int) -> None:
    """A CPU worker's tp group splits its cores between its ranks (`replica.tp.rank.share_cpu_threads`):
    at least one core per rank."""
    tp = cluster.tp_of(node)
    if 0 < cores < tp:
        raise cluster.error(cluster.tp_where(node),
                            f"{node.name}: a replica of tp {tp} needs a core per rank, but each of its "
                            f"{node.cpu_replicas} CPU worker(s) has {cores}")


def _one_numa(inv: Inventory, cores: tuple[int, ...]) -> int | None:
    nodes = {inv.cpus.numa_of(c) for c in cores}
    return nodes.pop() if len(nodes) == 1 else None


def _on_gpus(cluster: ClusterFile, node: NodeSpec, inv: Inventory) -> bool:
    """Whether `node`'s replicas run on its CUDA devices (else on CPU workers)."""
    mode = node.devices.mode
    return cluster.launch.device is not LaunchDevice.CPU and (
        mode is DeviceMode.LIST or (mode is DeviceMode.AUTO and bool(inv.gpus)))


def _slots(cluster: ClusterFile, node: NodeSpec, inv: Inventory) -> list[_Slot]:
    if _on_gpus(cluster, node, inv):
        return _gpu_slots(cluster, node, inv)
    device = cluster.launch.device
    if device is LaunchDevice.CUDA:
        raise cluster.error(("launch", "device"), f"the launch's device is cuda, but discovery found no "
                                                  f"CUDA device on {node.name}")
    return _cpu_slots(cluster, node, inv)


def _check_fabric(cluster: ClusterFile, node: NodeSpec, inv: Inventory, slots: list[_Slot]) -> None:
    fabric = cluster.launch.fabric
    if fabric.needs_cuda and any(s.device == "cpu" for s in slots):
        raise cluster.error(("launch", "fabric"), f"fabric {fabric.value} needs a CUDA device for every "
                                                  f"replica, but discovery found none on {node.name}")
    if fabric is Fabric.RDMA and not inv.rdma_devices:
        raise cluster.error(("launch", "fabric"), f"fabric rdma needs an RDMA NIC, but discovery found none "
                                                  f"on {node.name} (/sys/class/infiniband is empty)")


def place(cluster: ClusterFile, inventories: dict[int, Inventory]) -> list[Placement]:
    """Every replica of the cluster file on the devices each node reported; ranks in node order."""
    placements: list[Placement] = []
    for node in cluster.nodes:
        inv = inventories[node.index]
        if inv.model_problem:
            raise cluster.error(("model", "path"), f"on {node.name}: {inv.model_problem}")
        slots = _slots(cluster, node, inv)
        roles = node.roles(len(slots))
        _check_fit(cluster, node, inv, len(roles), len(slots))
        _check_fabric(cluster, node, inv, slots[:len(roles)])
        tp = cluster.tp_of(node)
        wanted = ports_per_replica(tp) * len(roles)
        if len(inv.ports) < wanted:
            raise cluster.error(("nodes", node.index), f"{node.name} drew {len(inv.ports)} free ports, "
                                                       f"{wanted} needed")
        first = sum(p.tp for p in placements)
        here = [_placement(first + local * tp, role, node, slot, inv.ports, local, tp)
                for local, (role, slot) in enumerate(zip(roles, slots, strict=False))]
        placements += _share_devices(here) if shares_devices(cluster.launch.fabric) else here
    return placements


def _placement(rank: int, role: str, node: NodeSpec, slot: _Slot, ports: tuple[int, ...], local: int,
               tp: int) -> Placement:
    """The `local`-th replica of a node: its ports are the node's drawn ports from `local` * (1 + tp)
    on (gRPC, then a transfer port per rank)."""
    mine = ports[ports_per_replica(tp) * local:ports_per_replica(tp) * (local + 1)]
    return Placement(rank, role, node, slot.device, mine[0], mine[1], slot.engine_cpus, slot.nic,
                     slot.rdma_device, slot.numa_node, group_ordinals=slot.ordinals, group_ports=mine[2:])


def _check_fit(cluster: ClusterFile, node: NodeSpec, inv: Inventory, replicas: int, slots: int) -> None:
    """The node has a slot (a tp group's devices, or a CPU worker) for each replica it asks for."""
    if replicas <= slots and slots:
        return
    tp, replicas = cluster.tp_of(node), max(replicas, 1)  # `role = ...` on a node where no group fits
    if not _on_gpus(cluster, node, inv):
        raise cluster.error(("nodes", node.index), f"{node.name} asks for {replicas} replicas but has "
                                                   f"{slots} CPU worker(s)")
    if tp == 1:
        raise cluster.error(("nodes", node.index), f"{node.name} asks for {replicas} replicas but has "
                                                   f"{slots} CUDA device(s)")
    raise cluster.error(cluster.tp_where(node),
                        f"{node.name} asks for {replicas} replica(s) of tp {tp} ({replicas * tp} CUDA "
                        f"devices, a group's ranks on one node) but has {len(inv.gpus)}")


def shares_devices(fabric: Fabric) -> bool:
    """Whether the replicas of a node all see its CUDA devices under the same indices: cuda-ipc opens
    a peer's memory by the device index its handle names (and `auto` may pick cuda-ipc)."""
    return fabric in (Fabric.CUDA_IPC, Fabric.AUTO)


def _share_devices(placements: list[Placement]) -> list[Placement]:
    """One node's placements, each seeing every CUDA device the node's replicas use; a tp group's
    devices stay adjacent in rank order (its rank r runs on the visible device after rank 0's + r)."""
    if all(p.tp == 1 for p in placements):
        shared = tuple(sorted({p.ordinal for p in placements if p.ordinal is not None}))
    else:
        shared = tuple(o for p in placements for o in (p.group_ordinals or (p.ordinal,)) if o is not None)
    return [replace(p, shared_devices=shared) if p.ordinal is not None else p for p in placements]


def rank_table(placements: list[Placement], store: str = "") -> RankTable:
    """The rank table every replica reads (the same format as `pdcluster up`'s); `store`: the
    rendezvous store's "HOST:PORT" (nccl, rdma, auto: the launch serves it)."""
    return RankTable.from_records((record for p in placements for record in _rank_records(p)), store)


def _rank_records(p: Placement) -> list[dict[str, object]]:
    """One rank-table entry per rank of the replica's group (rank 0 holds the gRPC port; the group's
    NIC is rank 0's; ranks 1.. say `tp_group` = rank 0's rank, which gives them fabric endpoints of
    their own, `replica/tp`)."""
    ports = (p.transfer_port, *p.group_ports)
    return [{"rank": p.rank + r, "host": p.node.address, "node": p.node.name, "device": device,
             "transfer_address": f"{p.node.transfer_host}:{ports[r]}", "grpc_port": p.port if r == 0 else 0,
             "nic": p.nic, "rdma_device": p.rdma_device, "numa_node": p.numa_node,
             "nic_gbps": p.node.nic_gbps, **({"tp_group": p.rank} if r else {})}
            for r, device in enumerate(p.rank_devices)]


# --- commands -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Commands:
    """What every command line of one launch needs to know besides the placement."""

    cluster: ClusterFile
    run_id: str
    pdcluster: tuple[str, ...]  # the pdcluster command on the nodes (default for each)
    workdir: PurePosixPath

    @property
    def node_dir(self) -> PurePosixPath:
        """This run's folder on every node: the staged rank table and the replicas' pid files."""
        return PurePosixPath("/tmp") / f"pdcluster-{self.run_id}"

    def command_of(self, node: NodeSpec) -> list[str]:
        """The pdcluster command on `node`."""
        return shlex.split(node.pdcluster) if node.pdcluster else list(self.pdcluster)

    def probe_script(self, node: NodeSpec) -> str:
        """Discovery on `node`: its devices, free ports, the NIC of its transfer address, the model."""
        tp = self.cluster.tp_of(node)
        args = ["devices", "--json", "--ports", str(ports_wanted(node, tp)), "--bind", node.transfer_host,
                "--check-model", str(self.cluster.model.path)]
        return f"cd {_q(self.workdir)} || exit 1\nexec {shlex.join([*self.command_of(node), *args])}"

    def stage_script(self) -> str:
        """Store the files read from stdin (`security.bundle`: base64 of a tar of the rank table and,
        with [tls] / a token, this node's certificate, key, CA and the token) in this run's folder on
        a node, owner-only, before any replica there starts."""
        d = _q(self.node_dir)
        # unpacked beside the folder, then renamed in: nodes sharing a /tmp never see a half-written file
        temp = f"{d}/.stage.$(hostname).$$"
        return (f"umask 077 && mkdir -p {d} && mkdir {temp} && base64 -d | tar -x -C {temp} && "
                f"mv -f {temp}/* {d}/ && rmdir {temp}")

    def wheelhouse_script(self, node: NodeSpec, project_wheel: str, extras: list[str]) -> str:
        """Unpack the wheelhouse tar read from stdin into this run's folder on `node` and install
        pdcluster from it with the node's Python, never reaching a registry: its dependencies
        (`pip install --no-index`, torch already there), then its own wheel again (`--force-reinstall
        --no-deps`: the version number does not change between checkouts)."""
        d = self.node_dir / "wheelhouse"
        python = shlex.join(node_python(self.command_of(node)))
        target = f"pdcluster[{','.join(extras)}]" if extras else "pdcluster"
        pip = f"{python} -m pip install --no-index --find-links {_q(d)} --disable-pip-version-check -q"
        return (f"umask 077 && mkdir -p {_q(d)} && tar -x -C {_q(d)} && "
                f"{pip} {shlex.quote(target)} && "
                f"{pip} --no-deps --force-reinstall {_q(d / project_wheel)}")

    def staged_files(self, node: NodeSpec) -> dict[str, Path]:
        """The files of this machine staged on `node` besides the rank table (name there -> file here)."""
        return self.cluster.security.node_files(node.address)

    def replica_args(self, p: Placement) -> list[str]:
        """Arguments of `pdcluster replica` for one placement."""
        launch, model = self.cluster.launch, self.cluster.model
        args = ["replica", "--model", str(model.path), "--rank", str(p.rank),
                "--cluster", str(self.node_dir / "ranks.json"), "--fabric", launch.fabric.value,
                "--host", p.node.address, "--port", str(p.port), "--num-blocks", str(launch.num_blocks)]
        if model.root is not None:
            args += ["--model-root", str(model.root)]
        args += self.device_args(p)
        if p.tp > 1:
            args += ["--tp", str(p.tp)]
        threads = launch.torch_threads or len(p.engine_cpus)
        if threads:
            args += ["--torch-threads", str(threads)]
        if p.engine_cpus:
            args += ["--engine-cpus", *map(str, p.engine_cpus)]
        args += self.cluster.security.replica_args(p.node.address, self.node_dir)
        if self.cluster.models:  # room in the weight buffer for the largest model it may hold
            args += ["--weight-buffer-models", str(model.path), *(str(m.path) for m in self.cluster.models)]
        args += flag_args(launch.replica_flags)
        return [*args, "--inactive"] if p.role == "inactive" else args

    def device_args(self, p: Placement) -> list[str]:
        """`--device` (and `--gpu-memory-fraction` on CUDA) of one replica.

        A CUDA replica starts with `CUDA_VISIBLE_DEVICES=N` (the rank table's `cuda:N`), so that
        device is the only one it sees: `--device cuda` (its cuda:0). On cuda-ipc (and auto) every
        replica of a node sees the node's devices in use (`shares_devices`),
        `CUDA_VISIBLE_DEVICES=N,M,…`, and picks its own with `--device cuda:K`. A CPU worker gets
        `--device cpu`, so it stays on the CPU on a node that has GPUs too.
        """
        if p.ordinal is None:
            return ["--device", "cpu"]
        fraction = p.node.gpu_memory_fraction or self.cluster.launch.gpu_memory_fraction
        return ["--device", p.torch_device, "--gpu-memory-fraction", f"{fraction:g}"]

    def replica_script(self, p: Placement) -> str:
        """The script run on the node: record its pid, set its device, exec the replica.

        `exec` keeps the pid written (so `down` can find it) and makes the replica the session's
        own process, so a hangup (ssh) or a step signal (srun) reaches it directly.
        """
        env = [("CUDA_VISIBLE_DEVICES", p.cuda_visible_devices), *p.node.env]
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env)
        pid = self.node_dir / f"{p.name}.pid"
        return "\n".join([
            f"cd {_q(self.workdir)} || exit 1",
            f"echo $$ > {_q(pid)} || exit 1",
            f"export {exports}",
            f"exec {shlex.join([*self.command_of(p.node), *self.replica_args(p)])} 2>&1",
        ])

    def stop_script(self, grace_s: float = 15.0) -> str:
        """SIGTERM this run's replicas on a node (by their pid files, and only processes whose command
        line names this run), SIGKILL what outlives `grace_s`, remove the run's folder."""
        d, tag = _q(self.node_dir), shlex.quote(self.run_id)
        ticks = max(1, int(grace_s * 10))
        return f"""d={d}; tag={tag}
[ -d "$d" ] || exit 0
mine() {{ tr '\\0' ' ' < /proc/$1/cmdline 2>/dev/null | grep -q -- "$tag"; }}
pids=""
for f in "$d"/*.pid; do [ -f "$f" ] || continue; p=$(cat "$f"); mine "$p" && pids="$pids $p"; done
[ -n "$pids" ] && kill -TERM $pids 2>/dev/null
left="$pids"
for _ in $(seq {ticks}); do
  [ -z "$left" ] && break
  sleep 0.1; now=""; for p in $left; do mine "$p" && now="$now $p"; done; left="$now"
done
[ -n "$left" ] && kill -KILL $left 2>/dev/null
rm -rf "$d"
echo "stopped:$pids killed:$left"
"""


def node_python(command: list[str]) -> list[str]:
    """The Python whose environment holds the node's pdcluster command: VENV/bin/python beside
    VENV/bin/pdcluster, the interpreter of `python -m pdcluster`, else `python3` on the PATH."""
    if len(command) >= 3 and command[1:3] == ["-m", "pdcluster"]:
        return [command[0]]
    if command and PurePosixPath(command[0]).name == "pdcluster" and "/" in command[0]:
        return [str(PurePosixPath(command[0]).parent / "python")]
    return ["python3"]


def _q(path: PurePosixPath | Path) -> str:
    return shlex.quote(str(path))


def ssh_argv(ssh: SshSpec, node: NodeSpec, tty: bool) -> list[str]:
    """`ssh` up to (and with) the destination: BatchMode (no password prompt), the file's options."""
    argv = ["ssh", "-tt" if tty else "-T", "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={ssh.connect_timeout_s:g}"]
    if ssh.config is not None:
        argv += ["-F", str(ssh.config)]
    if ssh.identity is not None:
        argv += ["-i", str(ssh.identity)]
    for option in ssh.options:
        argv += ["-o", option]
    if node.ssh_port != 22:
        argv += ["-p", str(node.ssh_port)]
    if node.ssh_user:
        argv += ["-l", node.ssh_user]
    return [*argv, node.address]


def wrap(via: Via, cluster: ClusterFile, node: NodeSpec, script: str, tty: bool = False,
         name: str = "") -> list[str]:
    """argv that runs `script` on `node` and streams its output back here.

    ssh: `-tt` (for replicas) gives the command a terminal, so closing the session hangs it up and
    the replica dies with it; the remote login shell runs `bash -c SCRIPT`. srun: one task on that
    node of the allocation this launch runs in; signalling srun signals the step.
    """
    if via is Via.SSH:
        return [*ssh_argv(cluster.ssh, node, tty), "bash -c " + shlex.quote(script)]
    if via is Via.SLURM:
        extra = [f"--job-name={name}", "--kill-on-bad-exit=1"] if name else []
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.name}", "--overlap", *extra,
                "bash", "-c", script]
    return ["bash", "-c", script]


def router_args(cluster: ClusterFile, placements: list[Placement]) -> list[str]:
    """Arguments of `pdcluster router` over the placed replicas."""
    r = cluster.router
    args = ["router", "--model", str(cluster.model.path), "--host", r.host, "--http-port", str(r.http_port),
            "--admin-port", str(r.admin_port), "--strategy", r.strategy, "--scaling", r.scaling,
            "--replica", *[p.address for p in placements], "--role", *[p.role for p in placements],
            *cluster.security.router_args(r.host), *flag_args(r.flags)]
    if cluster.models:
        args += ["--models", *(m.router_arg() for m in cluster.models)]
    return [*args, "--admin-token", r.admin_token] if r.admin_token else args
