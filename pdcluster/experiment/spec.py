"""The experiment file's contents as frozen dataclasses (pure; `load.py` reads and checks the TOML).

```
 Experiment ─┬─ model: ModelSpec            the checkpoint (built as a tiny model when missing)
             ├─ clusters: [ClusterShape]    prefill / decode / inactive replica counts
             ├─ strategies: [str]           KV-migration strategy names, passed to `pdcluster router`
             ├─ policies: [str]             scaling-policy names (`static`: no autoscaling)
             ├─ workloads: [WorkloadSpec]   one per offered rate
             ├─ topologies: [TopologySpec]  nodes, links, the backend that emulates them
             ├─ endpoints: [EndpointSpec]   OpenAI servers measured beside the local clusters
             ├─ slo: Slo                    TTFT / TPOT / E2EL limits (ms)
             └─ repetitions, seeds          each cell runs once per seed
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.engine import EngineSpec

STRATEGIES = ("full", "progressive", "mutate", "recompute", "colocated")
"""The router's built-in migration strategies (others may be registered; names pass through)."""
STATIC_POLICY = "static"
ARRIVALS = ("poisson", "gamma", "trace", "phases")
BACKENDS = ("pacing", "kernel")
ROLES = ("prefill", "decode", "inactive")


@dataclass(frozen=True)
class ModelSpec:
    """The checkpoint every local cluster serves."""

    path: Path
    tiny: dict[str, Any] = field(default_factory=dict)  # make-tiny-model options when `path` is missing
    num_blocks: int | None = None  # None: 512 (torch), what the GPU's memory leaves (simulated)
    torch_threads: int = 0  # per replica; 0 = this machine's cores shared by the replicas
    # every cluster's, unless the cluster names its own
    engine: EngineSpec = field(default_factory=EngineSpec)


@dataclass(frozen=True)
class ClusterShape:
    """How many replicas of each role a local cluster has."""

    name: str
    prefill: int = 1
    decode: int = 1
    inactive: int = 0
    router_args: tuple[str, ...] = ()  # more `pdcluster router` flags (batch budgets, migration bounds)
    replica_args: tuple[str, ...] = ()  # more `pdcluster replica` flags, for every replica
    # torch, or the simulated GPU and card (the [model] one by default)
    engine: EngineSpec = field(default_factory=EngineSpec)

    def roles(self) -> list[str]:
        """The role of each replica, by rank (prefill first, then decode, then inactive)."""
        return ["prefill"] * self.prefill + ["decode"] * self.decode + ["inactive"] * self.inactive


@dataclass(frozen=True)
class LengthSpec:
    """Token lengths: fixed (`low == high`) or uniform in [low, high]."""

    low: int
    high: int


@dataclass(frozen=True)
class WorkloadSpec:
    """What one cell sends: synthetic arrivals at `rate`, Poisson phases, or a replayed trace
    (rate-scaled when given)."""

    name: str
    arrival: str  # poisson | gamma | trace | phases
    num: int
    rate: float = math.inf  # requests/s; for a trace, 0 = its own rate (times divided by `speed`)
    cv: float = 1.0
    input_len: LengthSpec = LengthSpec(128, 128)
    output_len: LengthSpec = LengthSpec(32, 32)
    lengths_from: Path | None = None  # synthetic arrivals, (input, output) pairs drawn from this trace
    trace: Path | None = None
    format: str = ""
    window: tuple[float, float] | None = None
    speed: float = 1.0
    models: tuple[str, ...] = ()  # several models: each request asks for one (workloads.assign_models)
    max_input_len: int = 0  # 0: the served model's limit
    max_output_len: int = 0
    phases: tuple[tuple[float, float], ...] = ()  # phases: (seconds, requests/s), Poisson within each

    @property
    def family(self) -> str:
        """The workload's name without its rate (`chat@2` → `chat`): one line of a rate sweep."""
        return self.name.partition("@")[0]


@dataclass(frozen=True)
class NodeSpec:
    """One host of the topology: its replicas and its links."""

    name: str
    replicas: int | tuple[str, ...]  # slots filled in rank order, or the roles placed here
    nic_gbps: float = 0.0  # this node's NIC, both directions; 0 = unlimited
    intra_gbps: float = 0.0  # between replicas of this node; 0 = unlimited
    latency_ms: float = 0.0  # one way, added to every packet leaving the node
    host_models: tuple[str, ...] = ()  # models its host memory holds at start (processes: --host-models)


@dataclass(frozen=True)
class TopologySpec:
    """Nodes and links, emulated by the transfer fabric's pacing or by the kernel (namespaces and tc)."""

    name: str
    backend: str = "pacing"
    nodes: tuple[NodeSpec, ...] = ()

    def place(self, roles: list[str]) -> list[int]:
        """The node index of each rank (ValueError when the nodes do not fit the roles)."""
        if not self.nodes:
            return [0] * len(roles)
        if all(isinstance(n.replicas, tuple) for n in self.nodes):
            return self._place_roles(roles)
        slots = [i for i, n in enumerate(self.nodes) for _ in range(_slots(n.replicas))]
        if len(slots) < len(roles):
            raise ValueError(f"topology {self.name!r} has {len(slots)} replica slots, the cluster "
                             f"{len(roles)} replicas")
        return slots[: len(roles)]

    def _place_roles(self, roles: list[str]) -> list[int]:
        wanted: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            assert isinstance(node.replicas, tuple)
            for role in node.replicas:
                wanted.setdefault(role, []).append(i)
        placed = []
        for role in roles:
            if not wanted.get(role):
                raise ValueError(f"topology {self.name!r} places fewer {role} replicas than the cluster has")
            placed.append(wanted[role].pop(0))
        if any(wanted.values()):
            raise ValueError(f"topology {self.name!r} places more replicas than the cluster has")
        return placed


def _slots(replicas: int | tuple[str, ...]) -> int:
    return replicas if isinstance(replicas, int) else len(replicas)


LOCAL = TopologySpec("local")
"""One node, nothing emulated: the default topology."""


@dataclass(frozen=True)
class EndpointSpec:
    """An OpenAI server measured like a local cluster: at `url`, started by `launch` when given."""

    name: str
    url: str
    launch: tuple[str, ...] = ()  # argv; {model}, {host}, {port} are filled in
    requires: tuple[str, ...] = ()  # paths that must exist, else the cell is skipped with the reason
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 900.0
    max_model_len: int = 0  # when the server tells none
    workloads: tuple[str, ...] = ()  # workloads (names or families) it runs in the product; () = all


@dataclass(frozen=True)
class Slo:
    """Per-request limits in milliseconds (0: not checked)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2el_ms: float = 0.0

    def limits(self) -> dict[str, float]:
        """{"ttft": ms, ...} of the limits that are set (the shape `stats.summarize` takes)."""
        named = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {name: ms for name, ms in named.items() if ms > 0}


@dataclass(frozen=True)
class CellChoice:
    """One entry of an explicit matrix (`matrix = "list"`): names of the parts (empty: the only one)."""

    workload: str
    cluster: str = ""
    strategy: str = ""
    policy: str = ""
    topology: str = ""
    endpoint: str = ""


@dataclass(frozen=True)
class Experiment:
    """A whole experiment file."""

    name: str
    source: Path  # the file it was read from
    model: ModelSpec
    clusters: tuple[ClusterShape, ...]
    strategies: tuple[str, ...]
    policies: tuple[str, ...]
    workloads: tuple[WorkloadSpec, ...]
    topologies: tuple[TopologySpec, ...]
    endpoints: tuple[EndpointSpec, ...]
    slo: Slo
    seeds: tuple[int, ...]
    cells: tuple[CellChoice, ...] = ()  # explicit list; empty = the cartesian product
    request_timeout: float = 300.0
    startup_timeout: float = 300.0
