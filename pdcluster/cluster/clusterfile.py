"""The cluster file: one TOML file says what runs where (`pdcluster launch FILE`, `status`, `down`).

```
 cluster.toml ──tomllib──► values ──┐
             ──toml_lines─► lines ──┴─► parse() ─► ClusterFile (model, router, launch, ssh, nodes,
                                                                     security: [tls], [cluster])
                                        every check names its line: "cluster.toml:14: ..."
```
Checked before anything starts: unknown keys, duplicate node addresses or names, a CUDA device
listed twice, more replicas on a node than it has devices (or CPU workers), a fabric the nodes
cannot use, a certificate or token file the launch would hand out that is missing or unreadable
(`security.check_files`; `pdcluster down` skips those, to stop a run whatever became of them).
What only discovery can tell (how many devices `devices = "auto"` finds) is checked against the
same lines once each node has answered (`ClusterFile.error`).
The commented example is in `pdcluster/cluster/README.md`.
"""

from __future__ import annotations

import enum
import functools
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pdcluster.cluster.extra_flags import (
    REPLICA_OWN,
    ROUTER_OWN,
    Flags,
    parse_flags,
    replica_fields,
    router_fields,
)
from pdcluster.cluster.models_table import MODEL_KEYS, ModelEntry, check_entries, parse_entry
from pdcluster.cluster.security import Security, check_files
from pdcluster.cluster.toml_lines import Path_, line_of, locate

ROLES = ("prefill", "decode", "colocated", "inactive")
SERVING_ROLES = ("prefill", "decode", "colocated")

T = TypeVar("T")


class ClusterFileError(ValueError):
    """The cluster file is unusable; the message starts with `FILE:LINE:`."""


class Via(enum.Enum):
    """How replica commands reach their nodes."""

    SSH = "ssh"
    SLURM = "slurm"  # srun steps inside the allocation `pdcluster launch` runs in
    LOCAL = "local"  # local subprocesses (one-machine clusters, tests)


class Fabric(enum.Enum):
    """The transfer fabric of every replica."""

    TCP = "tcp"
    CUDA_IPC = "cuda-ipc"  # every replica on one node, each on a CUDA device
    NCCL = "nccl"  # CUDA devices on every node that runs a replica
    RDMA = "rdma"  # an RDMA NIC on every such node
    AUTO = "auto"  # each replica picks (`transfer.fabric.choose_fabric`): cuda-ipc, nccl/rdma or tcp

    @property
    def needs_cuda(self) -> bool:
        """Whether every replica needs a CUDA device."""
        return self in (Fabric.NCCL, Fabric.CUDA_IPC)


class LaunchDevice(enum.Enum):
    """`[launch] device` (`--device`): what every node's replicas run on."""

    AUTO = "auto"  # each node's `devices`: its CUDA devices where discovery finds some, else CPU workers
    CPU = "cpu"  # CPU workers everywhere, GPUs or not
    CUDA = "cuda"  # a CUDA device for every replica: a node where discovery finds none fails the launch


class DeviceMode(enum.Enum):
    """What a node's `devices` says."""

    AUTO = "auto"  # what discovery finds: its CUDA devices, else CPU workers
    CPU = "cpu"
    LIST = "list"  # these CUDA ordinals


@dataclass(frozen=True)
class Devices:
    """A node's `devices`: "auto", "cpu" or a list of CUDA ordinals."""

    mode: DeviceMode
    ordinals: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeSpec:
    """One `[[nodes]]` table."""

    index: int
    name: str  # its hostname (the Slurm node name under `via = "slurm"`)
    address: str  # where ssh and the router reach it
    devices: Devices
    counts: tuple[tuple[str, int], ...]  # (role, replicas) in ROLES order; empty when `role` is set
    role: str = ""  # every device (or CPU worker) of the node takes this role
    ssh_user: str = ""
    ssh_port: int = 22
    transfer_address: str = ""  # the transfer fabric's address on this node; default: `address`
    nic_gbps: float = 0.0  # its NIC's rate, recorded in the rank table (0: not given)
    cpu_replicas: int = 1  # CPU workers on a node without CUDA devices, each on its own cores
    env: tuple[tuple[str, str], ...] = ()  # set for every replica on this node
    pdcluster: str = ""  # the pdcluster command on this node; default: the launch's
    gpu_memory_fraction: float | None = None  # its replicas' share of their GPU; None: the launch's
    tp: int = 0  # ranks of each of its replicas' tensor-parallel groups; 0: the launch's `tp`

    @property
    def transfer_host(self) -> str:
        """The address the transfer fabric listens on."""
        return self.transfer_address or self.address

    def roles(self, slots: int) -> list[str]:
        """The role of each replica on this node, given its device (or CPU worker) count."""
        if self.role:
            return [self.role] * slots
        return [role for role, count in self.counts for _ in range(count)]


@dataclass(frozen=True)
class ModelSpec:
    """`[model]`."""

    path: Path
    root: Path | None = None  # LoadParams reads only under it; default: the path's parent


@dataclass(frozen=True)
class RouterSpec:
    """`[router]`: the router runs where `pdcluster launch` runs and binds `host`."""

    host: str = "127.0.0.1"
    http_port: int = 8080
    admin_port: int = 50100
    admin_token: str = ""
    strategy: str = "full"  # a migration strategy registered in router/strategies/
    scaling: str = "static"  # a scaling policy of router/scaling/policies.py
    flags: Flags = ()  # more router flags (`extra_flags.py`)


@dataclass(frozen=True)
class LaunchSpec:
    """`[launch]`."""

    log_dir: Path
    via: Via = Via.SSH
    fabric: Fabric = Fabric.TCP
    pdcluster: str = ""  # the pdcluster command on the nodes; empty: the one running the launch
    workdir: Path | None = None  # where replicas start on the nodes; default: this package's root
    ready_timeout_s: float = 300.0
    num_blocks: int = 512
    torch_threads: int = 0
    max_restarts: int = 3  # restarts of one replica within `restart_window_s` before the launch gives up
    restart_window_s: float = 300.0
    fanout: int = 32  # ssh / srun sessions opened at once (discovery, stop, log collection)
    replica_flags: Flags = ()  # more flags of every replica (`extra_flags.py`)
    device: LaunchDevice = LaunchDevice.AUTO
    gpu_memory_fraction: float = 0.9  # the share of its GPU each CUDA replica may take
    wheelhouse: Path | None = None  # `pdcluster wheelhouse` folder installed on every node first
    tp: int = 1  # every replica a tensor-parallel group of this many ranks (a node's `tp` overrides)


@dataclass(frozen=True)
class SshSpec:
    """`[ssh]`: how this machine reaches the nodes (BatchMode, never a password prompt)."""

    config: Path | None = None  # ssh -F
    identity: Path | None = None  # ssh -i
    options: tuple[str, ...] = ()  # ssh -o, each "Key=Value"
    connect_timeout_s: float = 10.0


@dataclass(frozen=True)
class ClusterFile:
    """A parsed and checked cluster file."""

    path: Path
    model: ModelSpec
    router: RouterSpec
    launch: LaunchSpec
    ssh: SshSpec
    nodes: tuple[NodeSpec, ...]
    lines: dict[Path_, int]
    security: Security = field(default_factory=Security)  # [tls] and [cluster] token_file
    models: tuple[ModelEntry, ...] = ()  # [[models]]: more models beside [model] (`models_table.py`)

    def error(self, where: Path_, message: str) -> ClusterFileError:
        """An error about the value at `where` (e.g. ("nodes", 2, "devices")), naming its line."""
        return ClusterFileError(f"{self.path}:{line_of(self.lines, where)}: {message}")

    def tp_of(self, node: NodeSpec) -> int:
        """The tensor-parallel degree of `node`'s replicas: its own `tp`, else the launch's."""
        return node.tp or self.launch.tp

    def tp_where(self, node: NodeSpec) -> Path_:
        """The line that sets `node`'s `tp` (for errors about a group that does not fit)."""
        return ("nodes", node.index, "tp") if node.tp else ("launch", "tp")


_TOP = {"model", "router", "launch", "ssh", "nodes", "tls", "cluster", "models"}
_TLS = {"certs", "mutual", "router_name", "client"}
_CLUSTER = {"token_file"}
_MODEL = {"path", "root"}
_ROUTER = {"host", "http_port", "admin_port", "admin_token", "strategy", "scaling", "flags"}
_LAUNCH = {"via", "fabric", "log_dir", "pdcluster", "workdir", "ready_timeout_s", "num_blocks",
           "torch_threads", "max_restarts", "restart_window_s", "fanout", "replica_flags", "device",
           "gpu_memory_fraction", "wheelhouse", "tp"}
_SSH = {"config", "identity", "options", "connect_timeout_s"}
_NODE = {"name", "address", "ssh_user", "ssh_port", "transfer_address", "nic_gbps", "devices", "role",
         "cpu_replicas", "env", "pdcluster", "gpu_memory_fraction", "tp", *ROLES}


class _Table:
    """One TOML table being read: typed getters that name the line of a bad value."""

    def __init__(self, file: Path, lines: dict[Path_, int], where: Path_, values: object,
                 allowed: set[str]) -> None:
        self.file, self.lines, self.where = file, lines, where
        if not isinstance(values, dict):
            raise self.error((), f"{self.name()} must be a table")
        self.values: dict[str, Any] = values
        for key in values:
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                raise self.error((key,), f"unknown key {self.name(key)!r} (known: {known})")

    def name(self, key: str = "") -> str:
        parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*self.where, *([key] if key else []))]
        return "".join(parts).lstrip(".")

    def error(self, key: tuple[str, ...], message: str) -> ClusterFileError:
        return ClusterFileError(f"{self.file}:{line_of(self.lines, (*self.where, *key))}: {message}")

    def get(self, key: str, kind: type[T], default: T, check: Callable[[T], str] | None = None) -> T:
        if key not in self.values:
            return default
        value = self.values[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise self.error((key,), f"{self.name(key)} must be {kind.__name__}, not {value!r}")
        problem = check(value) if check else ""
        if problem:
            raise self.error((key,), f"{self.name(key)} {problem}")
        return value

    def named(self, key: str, default: str, check: Callable[[str], object]) -> str:
        """A name `check` accepts (it raises ValueError naming the known ones otherwise)."""
        text = self.get(key, str, default)
        try:
            check(text)
        except ValueError as exc:
            raise self.error((key,), f"{self.name(key)}: {exc}") from None
        return text

    def flags(self, key: str, fields: set[str], own: frozenset[str]) -> Flags:
        """A table of more flags of a command (`extra_flags.py`)."""
        table = self.get(key, dict, {})

        def error(name: str, message: str) -> ClusterFileError:
            return self.error((key, name), f"{self.name(key)}: {message}")

        return parse_flags(table, fields, own, error)

    def choice(self, key: str, enum_type: type[enum.Enum], default: enum.Enum) -> Any:
        text = self.get(key, str, default.value)
        try:
            return enum_type(text)
        except ValueError:
            known = ", ".join(str(e.value) for e in enum_type)
            raise self.error((key,), f"{self.name(key)} must be one of {known}, not {text!r}") from None


def _at_least(low: float) -> Callable[[float], str]:
    return lambda value: "" if value >= low else f"must be >= {low:g}, not {value:g}"


def _fraction(value: float) -> str:
    return "" if 0 < value <= 1 else f"must be in (0, 1], not {value:g}"


def _port(value: int) -> str:
    return "" if 0 <= value <= 65535 else f"must be a port in [0, 65535], not {value}"


def _under(folder: Path, text: str) -> Path:
    """A path of the file, relative ones taken from the file's folder."""
    path = Path(text).expanduser()
    return path if path.is_absolute() else (folder / path).resolve()


def parse(path: Path, text: str | None = None, files: bool = True) -> ClusterFile:
    """Read and check the cluster file at `path` (or its `text`); `files`: also the certificate and
    token files it names."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ClusterFileError(f"cannot read cluster file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterFileError(f"{path}: not valid TOML: {exc}") from None
    lines = locate(text)
    folder = path.resolve().parent
    _Table(path, lines, (), data, _TOP)  # unknown top-level keys
    if "model" not in data:
        raise ClusterFileError(f"{path}:1: missing [model] table (path = the checkpoint folder)")
    if not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ClusterFileError(f"{path}:1: no [[nodes]] table: name at least one node")
    launch = _launch(_Table(path, lines, ("launch",), data.get("launch", {}), _LAUNCH), folder, path)
    nodes = tuple(_node(_Table(path, lines, ("nodes", i), raw, _NODE), i)
                  for i, raw in enumerate(data["nodes"]))
    model = _model(_Table(path, lines, ("model",), data["model"], _MODEL), folder)
    router = _router(_Table(path, lines, ("router",), data.get("router", {}), _ROUTER))
    ssh = _ssh(_Table(path, lines, ("ssh",), data.get("ssh", {}), _SSH), folder)
    security = _security(_Table(path, lines, ("tls",), data.get("tls", {}), _TLS),
                         _Table(path, lines, ("cluster",), data.get("cluster", {}), _CLUSTER), folder)
    models = _models(path, lines, data.get("models", []), folder, model)
    cluster = ClusterFile(path, model, router, launch, ssh, nodes, lines, security, models)
    _check_nodes(cluster)
    if files:
        check_files(security, [(n.index, n.address) for n in nodes], router.host, cluster.error)
    return cluster


def _model(t: _Table, folder: Path) -> ModelSpec:
    if "path" not in t.values:
        raise t.error((), "[model] needs path = the checkpoint folder")
    root = t.get("root", str, "")
    return ModelSpec(_under(folder, t.get("path", str, "")), _under(folder, root) if root else None)


def _models(path: Path, lines: dict[Path_, int], raw: object, folder: Path,
            model: ModelSpec) -> tuple[ModelEntry, ...]:
    """`[[models]]` (`models_table.py`), every refusal naming the entry's line."""
    if not isinstance(raw, list):
        raise ClusterFileError(f"{path}:{line_of(lines, ('models',))}: models must be [[models]] tables")
    tables = [_Table(path, lines, ("models", i), values, MODEL_KEYS) for i, values in enumerate(raw)]

    def fail(i: int, key: tuple[str, ...], message: str) -> ClusterFileError:
        return tables[i].error(key, f"{tables[i].name()}: {message}")

    entries = [parse_entry(t.values, functools.partial(_under, folder), functools.partial(fail, i))
               for i, t in enumerate(tables)]
    check_entries(entries, model.path.name, model.root or model.path.parent, fail)
    return tuple(entries)


def _router(t: _Table) -> RouterSpec:
    from router import strategies
    from router.scaling import policies

    return RouterSpec(t.get("host", str, "127.0.0.1"), t.get("http_port", int, 8080, _port),
                      t.get("admin_port", int, 50100, _port), t.get("admin_token", str, ""),
                      t.named("strategy", "full", strategies.get), t.named("scaling", "static", policies.get),
                      t.flags("flags", router_fields(), ROUTER_OWN))


def _launch(t: _Table, folder: Path, path: Path) -> LaunchSpec:
    workdir = t.get("workdir", str, "")
    wheelhouse = t.get("wheelhouse", str, "")
    return LaunchSpec(
        log_dir=_under(folder, t.get("log_dir", str, f"{path.stem}-logs")),
        via=t.choice("via", Via, Via.SSH), fabric=t.choice("fabric", Fabric, Fabric.TCP),
        pdcluster=t.get("pdcluster", str, ""), workdir=Path(workdir) if workdir else None,
        ready_timeout_s=t.get("ready_timeout_s", float, 300.0, _at_least(1)),
        num_blocks=t.get("num_blocks", int, 512, _at_least(1)),
        torch_threads=t.get("torch_threads", int, 0, _at_least(0)),
        max_restarts=t.get("max_restarts", int, 3, _at_least(0)),
        restart_window_s=t.get("restart_window_s", float, 300.0, _at_least(1)),
        fanout=t.get("fanout", int, 32, _at_least(1)),
        replica_flags=t.flags("replica_flags", replica_fields(), REPLICA_OWN),
        device=t.choice("device", LaunchDevice, LaunchDevice.AUTO),
        gpu_memory_fraction=t.get("gpu_memory_fraction", float, 0.9, _fraction),
        wheelhouse=_under(folder, wheelhouse) if wheelhouse else None,
        tp=t.get("tp", int, 1, _at_least(1)),
    )


def _security(tls: _Table, cluster: _Table, folder: Path) -> Security:
    token = cluster.get("token_file", str, "")
    if "certs" not in tls.values and tls.values:
        raise tls.error((), "[tls] needs certs = the folder `pdcluster make-certs` wrote")
    certs = tls.get("certs", str, "")
    names = {key: tls.get(key, str, default) for key, default in (("router_name", ""), ("client", "client"))}
    return Security(_under(folder, certs) if certs else None, tls.get("mutual", bool, False),
                    names["router_name"], names["client"], _under(folder, token) if token else None)


def _ssh(t: _Table, folder: Path) -> SshSpec:
    config, identity = t.get("config", str, ""), t.get("identity", str, "")
    options = t.get("options", list, [])
    if not all(isinstance(o, str) and "=" in o for o in options):
        raise t.error(("options",), "ssh.options must be a list of \"Key=Value\" strings")
    return SshSpec(_under(folder, config) if config else None, _under(folder, identity) if identity else None,
                   tuple(options), t.get("connect_timeout_s", float, 10.0, _at_least(1)))


def _devices(t: _Table) -> Devices:
    value = t.values.get("devices", "auto")
    if isinstance(value, str) and value in ("auto", "cpu"):
        return Devices(DeviceMode(value))
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise t.error(("devices",), f"{t.name('devices')} must be \"auto\", \"cpu\" or a list of CUDA "
                                    f"ordinals, not {value!r}")
    for position, ordinal in enumerate(value):
        if ordinal in value[:position]:
            raise t.error(("devices",), f"{t.name('devices')} lists CUDA device {ordinal} twice")
    if not value:
        raise t.error(("devices",), f"{t.name('devices')} is empty")
    return Devices(DeviceMode.LIST, tuple(value))


def _env(t: _Table) -> tuple[tuple[str, str], ...]:
    env = t.get("env", dict, {})
    bad = [k for k, v in env.items() if not k.isidentifier() or not isinstance(v, str)]
    if bad:
        raise t.error(("env",), f"{t.name('env')}: {bad[0]!r} needs a name like NCCL_SOCKET_IFNAME and a "
                                "string value")
    return tuple(sorted(env.items()))


def _node(t: _Table, index: int) -> NodeSpec:
    address = t.get("address", str, "") or t.get("name", str, "")
    if not address:
        raise t.error((), f"{t.name()} needs address = where ssh and the router reach it")
    role = t.get("role", str, "", lambda r: "" if r in ROLES else f"must be one of {', '.join(ROLES)}")
    counts = tuple((r, t.get(r, int, 0, _at_least(0))) for r in ROLES if r in t.values)
    if role and counts:
        raise t.error(("role",), f"{t.name()}: give either role = ... or counts per role, not both")
    if not role and not any(n for _, n in counts):
        raise t.error((), f"{t.name()} runs no replica: set role = \"decode\" (every device) or counts "
                          "like prefill = 1")
    devices = _devices(t)
    node = NodeSpec(
        index=index, name=t.get("name", str, address), address=address, devices=devices, counts=counts,
        role=role, ssh_user=t.get("ssh_user", str, ""), ssh_port=t.get("ssh_port", int, 22, _port),
        transfer_address=t.get("transfer_address", str, ""),
        nic_gbps=t.get("nic_gbps", float, 0.0, _at_least(0)),
        cpu_replicas=t.get("cpu_replicas", int, 1, _at_least(1)), env=_env(t),
        pdcluster=t.get("pdcluster", str, ""),
        gpu_memory_fraction=t.get("gpu_memory_fraction", float, 0.9, _fraction)
        if "gpu_memory_fraction" in t.values else None,
        tp=t.get("tp", int, 0, _at_least(1)),
    )
    if "cpu_replicas" in t.values and devices.mode is DeviceMode.LIST:
        raise t.error(("cpu_replicas",), f"{t.name('cpu_replicas')} is for CPU nodes; this one lists CUDA "
                                         "devices")
    wanted = sum(n for _, n in counts)
    slots = len(devices.ordinals) if devices.mode is DeviceMode.LIST else node.cpu_replicas
    if devices.mode is not DeviceMode.AUTO and wanted > slots:
        what = f"{slots} CUDA device(s)" if devices.mode is DeviceMode.LIST else (
            f"cpu_replicas = {slots} (raise it for more CPU workers, each on its own cores)")
        raise t.error(("devices",) if devices.mode is DeviceMode.LIST else (),
                      f"{t.name()} ({node.name}) asks for {wanted} replicas but has {what}")
    return node


def _check_nodes(cluster: ClusterFile) -> None:
    """Across nodes: unique addresses and names, a serving replica somewhere, a usable fabric."""
    addresses: dict[str, int] = {}
    names: dict[str, int] = {}
    for node in cluster.nodes:
        for key, value, seen in (("address", node.address, addresses), ("name", node.name, names)):
            if value in seen:
                raise cluster.error(("nodes", node.index, key), f"nodes[{node.index}] has the same {key} "
                                                                f"{value!r} as nodes[{seen[value]}]")
            seen[value] = node.index
    if not any(n.role in SERVING_ROLES or any(c for r, c in n.counts if r in SERVING_ROLES)
               for n in cluster.nodes):
        raise cluster.error(("nodes", 0), "no node runs a prefill, decode or colocated replica")
    fabric, device = cluster.launch.fabric, cluster.launch.device
    if fabric.needs_cuda and device is LaunchDevice.CPU:
        raise cluster.error(("launch", "fabric"), f"fabric {fabric.value} needs CUDA devices but the "
                                                  'launch\'s device is "cpu" (use fabric = "tcp")')
    if fabric is Fabric.CUDA_IPC and len(cluster.nodes) > 1:
        raise cluster.error(("launch", "fabric"), f"fabric cuda-ipc joins replicas on one host, but the file "
                                                  f"has {len(cluster.nodes)} nodes (use nccl, rdma or auto)")
    for node in cluster.nodes:
        if fabric.needs_cuda and node.devices.mode is DeviceMode.CPU:
            # rdma moves host memory too: only discovery can say (an RDMA NIC)
            raise cluster.error(("nodes", node.index, "devices"),
                                f"fabric {fabric.value} needs CUDA devices but {node.name} has devices = "
                                '"cpu" (use fabric = "tcp")')
        _check_device(cluster, node, device)
        _check_tp(cluster, node)


def _check_device(cluster: ClusterFile, node: NodeSpec, device: LaunchDevice) -> None:
    """A node's `devices` against the launch's `device` (the CUDA ones discovery checks later)."""
    if device is LaunchDevice.CPU and node.devices.mode is DeviceMode.LIST:
        raise cluster.error(("nodes", node.index, "devices"),
                            f"{node.name} lists CUDA devices but the launch's device is \"cpu\"")
    if device is LaunchDevice.CUDA and node.devices.mode is DeviceMode.CPU:
        raise cluster.error(("nodes", node.index, "devices"),
                            f"{node.name} has devices = \"cpu\" but the launch's device is \"cuda\"")


def _check_tp(cluster: ClusterFile, node: NodeSpec) -> None:
    """A node listing its CUDA devices has room for its tensor-parallel groups (each group's ranks on
    consecutive devices of the node: a group never spans nodes); `auto` and CPU nodes are checked
    once discovery has answered (`launch_plan.place`)."""
    tp = cluster.tp_of(node)
    if tp == 1 or node.devices.mode is not DeviceMode.LIST:
        return
    groups = sum(n for _, n in node.counts) if not node.role else 1
    have = len(node.devices.ordinals)
    if groups * tp > have:
        raise cluster.error(cluster.tp_where(node),
                            f"{node.name} asks for {groups} replica(s) of tp {tp} ({groups * tp} CUDA "
                            f"devices, a group's ranks on one node) but lists {have}")


def with_fabric(cluster: ClusterFile, fabric: Fabric) -> ClusterFile:
    """`cluster` with another fabric (`--fabric`), checked as the file's own would be."""
    return with_launch(cluster, fabric=fabric)


def with_launch(cluster: ClusterFile, **changes: Any) -> ClusterFile:
    """`cluster` with some `[launch]` values replaced (the command line's `--fabric`, `--device`,
    `--gpu-memory-fraction`, `--wheelhouse`), checked as the file's own would be."""
    fraction = changes.get("gpu_memory_fraction")
    if fraction is not None and _fraction(fraction):
        raise ValueError(f"--gpu-memory-fraction {_fraction(fraction)}")
    changed = replace(cluster, launch=replace(cluster.launch, **changes))
    _check_nodes(changed)
    return changed
