"""A cell's local cluster: replicas placed on the topology's nodes, and a router, as subprocesses.

```
 CellCluster.start() ─┬─ rank table: each rank on its node (pacing: loopback ports, the node's NIC as
                      │   `link_gbps`; kernel: the node's address inside its namespace, no pacing)
                      ├─ pdcluster replica --rank R …   (kernel: `ip netns exec <node> …`)
                      └─ pdcluster router --strategy NAME [--scaling NAME] [--timeline FILE] …
                                                         (kernel: in the head namespace)
```
Names of strategies and scaling policies go to the router as given; it refuses names it does not
know. A cluster of simulated GPUs (`engine = "simulated"`) gets its engine flags, and the router and
the replicas read a model folder made in the cell's folder: the card's config.json beside the
checkpoint's tokenizer (`pdcluster/cluster/engine.py`). `--scaling` and `--timeline` are passed only
to a router that has those flags (the router's autoscaling adds them); without `--scaling` only the
`static` policy runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from pdcluster.cluster.gpu_placement import place_on_devices
from pdcluster.cluster.processes import (
    REPLICA_READY,
    ROUTER_READY,
    Proc,
    parse_router_ready,
    pdcluster_argv,
    spawn,
    stop_procs,
)
from pdcluster.cluster.replica_process import free_ports
from pdcluster.discovery.discover import visible_gpu_count
from pdcluster.experiment.netns import HEAD_ADDRESS, Network
from pdcluster.experiment.spec import STATIC_POLICY, ClusterShape, ModelSpec, TopologySpec
from router.models import parse_model
from transfer.ranktable import RankEntry, RankTable

DEFAULT_PAGES = 512  # KV pages of a torch replica when the experiment names none
TRANSFER_BASE_PORT = 7100  # inside a node's namespace every port is free
ROUTER_HTTP_PORT = 8080
ROUTER_ADMIN_PORT = 50100


def router_flags() -> set[str]:
    """The option names `pdcluster router` has (its config dataclass's fields)."""
    from router.config import RouterConfig

    return {f.name for f in dataclasses.fields(RouterConfig)}


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class CellCluster:
    """The processes of one cell's local cluster; `stop()` ends every one of them."""

    def __init__(self, model: ModelSpec, shape: ClusterShape, strategy: str, policy: str,
                 topology: TopologySpec, folder: Path, network: Network | None = None) -> None:
        self.model = model
        self.shape = shape
        self.strategy = strategy
        self.policy = policy
        self.topology = topology
        self.folder = folder
        self.network = network
        self.roles = shape.roles()
        self.nodes = topology.place(self.roles)
        self.replicas: list[Proc] = []
        self.router: Proc | None = None
        self.http_url = ""
        self.timeline: Path | None = None
        self.model_dir = model.path
        self.router_extra = list(shape.router_args)  # the shape's router flags (--models rewritten)

    def start(self, timeout: float) -> None:
        """Start every replica, then the router; returns once the router's ready line came."""
        flags = router_flags()
        if "--models" in self.shape.router_args and not self.shape.engine.simulated:
            raise RuntimeError("several models (router --models) in an experiment need simulated replicas "
                               "(`pdcluster up --models` serves torch checkpoints)")
        if self.policy != STATIC_POLICY and "scaling" not in flags:
            raise RuntimeError(f"scaling policy {self.policy!r} needs the router's --scaling flag, which "
                               "this router does not have yet (only 'static' runs)")
        logs = self.folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        table = self._rank_table()
        (self.folder / "ranks.json").write_text(table.to_json())
        engine = self.shape.engine
        self.model_dir = engine.model_folder(self.model.path, self.folder / "model" / engine.model_card)
        self.router_extra, folders = several_models(self.shape.router_args, self.model_dir,
                                                    lambda d: engine.model_folder(self.model.path, d))
        dealt = deal(self.roles, folders)
        pages = self.model.num_blocks if engine.simulated else (self.model.num_blocks or DEFAULT_PAGES)
        gpus = 0 if engine.simulated or engine.device == "cpu" else visible_gpu_count()
        slots = place_on_devices(len(self.roles), "cpu" if engine.simulated else engine.device, gpus)
        deadline = time.monotonic() + timeout
        for rank, role in enumerate(self.roles):
            entry = table[rank]
            args = ["replica", "--model", str(dealt[rank]), "--host", entry.host, "--port", "0",
                    "--rank", str(rank), *(["--num-blocks", str(pages)] if pages else []),
                    "--torch-threads", str(self._threads()), "--cluster", str(self.folder / "ranks.json"),
                    "--fabric", engine.fabric, *(["--inactive"] if role == "inactive" else []),
                    *engine.replica_args(), *slots[rank].replica_args(), *self.host_model_args(rank),
                    *self.shape.replica_args]
            self.replicas.append(self._spawn(f"replica-{rank}-{role}", role, args, logs, self.nodes[rank],
                                             REPLICA_READY))
        for proc in self.replicas:
            proc.address = self._ready(proc, deadline)[len(REPLICA_READY):].strip()
        self.router = self._spawn("router", "router", self._router_args(flags), logs, None, ROUTER_READY)
        self.http_url, _ = parse_router_ready(self._ready(self.router, deadline))

    def _router_args(self, flags: set[str]) -> list[str]:
        host = HEAD_ADDRESS if self.network else "127.0.0.1"
        # fixed ports in the head's own namespace; free ones on the host's loopback
        http, admin = (ROUTER_HTTP_PORT, ROUTER_ADMIN_PORT) if self.network else (0, 0)
        args = ["router", "--model", str(self.model_dir), "--host", host, "--http-port", str(http),
                "--admin-port", str(admin), "--strategy", self.strategy,
                "--replica", *[p.address for p in self.replicas], "--role", *self.roles]
        args += self.router_extra
        if "scaling" in flags:
            args += ["--scaling", self.policy]
        if "timeline" in flags:
            self.timeline = self.folder / "timeline.jsonl"
            args += ["--timeline", str(self.timeline)]
        return args

    def host_model_args(self, rank: int) -> list[str]:
        """`--host-models` of the models rank `rank`'s node holds in host memory at start (topology
        `host_models`; each replica process holds its own copies, as its node's would)."""
        held = self.topology.nodes[self.nodes[rank]].host_models if self.topology.nodes else ()
        return ["--host-models", *held] if held else []

    def _threads(self) -> int:
        """Torch threads per replica: as the experiment says, else the cores shared by the replicas."""
        return self.model.torch_threads or max(1, (os.cpu_count() or 1) // len(self.roles))

    def _rank_table(self) -> RankTable:
        """Each rank on its node: loopback and paced NICs, or the node's address in its namespace."""
        entries = []
        ports = [] if self.network else free_ports(len(self.roles))
        for rank, node_index in enumerate(self.nodes):
            node = self.topology.nodes[node_index] if self.topology.nodes else None
            name = node.name if node else "n0"
            if self.network:
                host = self.network.node_of(node_index).address
                entries.append(RankEntry(rank, host, name, "cpu", f"{host}:{TRANSFER_BASE_PORT + rank}"))  # type: ignore[arg-type]
            else:
                gbps = node.nic_gbps if node else 0.0
                entries.append(RankEntry(rank, "127.0.0.1", name, "cpu", f"127.0.0.1:{ports[rank]}",  # type: ignore[arg-type]
                                         link_gbps=gbps))
        return RankTable(tuple(entries))

    def _spawn(self, name: str, role: str, args: list[str], logs: Path, node_index: int | None,
               ready: str) -> Proc:
        argv = pdcluster_argv(*args)
        if self.network is not None:
            node = self.network.head if node_index is None else self.network.node_of(node_index)
            argv = node.exec_argv(argv)
        return spawn(name, role, argv, logs / f"{name}.log", ready_prefix=ready)

    def _ready(self, proc: Proc, deadline: float) -> str:
        try:
            return proc.wait_ready(deadline)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log_tail(proc.log)}") from None

    def processes(self) -> list[Proc]:
        """Every process started (for the resource sampler)."""
        return [*self.replicas, *([self.router] if self.router else [])]

    def stop(self) -> None:
        """SIGTERM the router, then the replicas; SIGKILL what outlives 10 s."""
        stop_procs([self.router] if self.router else [], self.replicas, timeout=10.0)


def several_models(router_args: Sequence[str], first: Path, make: Callable[[Path], Path]
                   ) -> tuple[list[str], list[Path]]:
    """`router_args` with each `--models NAME=…` entry's folder made beside `first` (`make(folder)`
    writes it: the card's config.json and the tokenizer, so the replicas' LoadParams finds it under
    their model root by its name), and every model's folder, `first` first."""
    args, folders, models = [], [first], False
    for word in router_args:
        models = word == "--models" or (models and not word.startswith("--"))
        if models and word != "--models":
            spec = parse_model(word)
            folder = make(first.parent / spec.name)
            folders.append(folder)
            word = ",".join([f"{spec.name}={folder}", *word.split(",")[1:]])
        args.append(word)
    return args, folders


def deal(roles: Sequence[str], folders: Sequence[Path]) -> list[Path]:
    """Each replica's --model: the loaded ones dealt to the models in turn, each role on its own (a
    replica's Info names its model); inactive ones get the first (the shared spare pool)."""
    dealt: Counter[str] = Counter()
    out = []
    for role in roles:
        if role == "inactive":
            out.append(folders[0])
            continue
        out.append(folders[dealt[role] % len(folders)])
        dealt[role] += 1
    return out
