"""The scaling benchmark as an experiment file for the research harness (pure).

```
 Design ──experiment_toml()──► DIR/scaling.toml ──pdcluster.experiment──► DIR/cells/<system>…/
   systems: static, multicast, live, stop-the-world, host-cache on `burst` (1 prefill, 1 decode,
            N inactive), and static-peak: every one of the 2 + N replicas serving, policy static
   one workload: Poisson phases (quiet, a step to several times the load, quiet again)
   one topology: every replica its own node behind an emulated NIC (the fabric paces KV and weights)
```
Bandwidths keep a real cluster's ratios with a smaller checkpoint (router/scaling/README.md): each
one is the reference cluster's, scaled by the checkpoint's bytes over the reference model's, so a
load from disk, from host memory or over the network takes here what it takes there. With simulated
replicas (`engine`), the file names the GPU and model card in [model] and the bandwidths are the
reference cluster's own: a simulated replica moves the card's bytes times its byte scale and paces at
the given rates times the same scale, so every load and transfer takes its full-size time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.engine import EngineSpec

POLICIES = ("static", "multicast", "live", "stop-the-world", "host-cache")
PEAK = "static-peak"
SYSTEMS = (*POLICIES, PEAK)
"""What one run measures: each scaling policy on the small cluster, and a static cluster provisioned
for the peak."""
WORKLOAD = "burst"
TOPOLOGY = "nics"
STRATEGY = "full"


@dataclass(frozen=True)
class Reference:
    """The cluster whose ratios the emulated bandwidths keep: a 7 B model in 16-bit weights, NVMe,
    host memory and a 100 Gbit/s NIC per GPU."""

    model_bytes: float = 14e9
    disk_gbps: float = 16.0  # 2 GB/s NVMe
    host_gbps: float = 200.0  # 25 GB/s host-to-device copies
    nic_gbps: float = 100.0

    def seconds(self, gbps: float) -> float:
        """How long the reference model takes at `gbps` (the same here, with bandwidths scaled)."""
        return self.model_bytes * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class Bandwidths:
    """Emulated Gbit/s: every replica's NIC (KV and weight transfers), LoadParams from disk and from
    host memory."""

    link_gbps: float
    disk_gbps: float
    host_gbps: float

    @classmethod
    def scaled(cls, model_bytes: int, reference: Reference = Reference()) -> Bandwidths:
        """The reference cluster's bandwidths times model_bytes / reference model bytes."""
        f = model_bytes / reference.model_bytes
        return cls(round(reference.nic_gbps * f, 4), round(reference.disk_gbps * f, 4),
                   round(reference.host_gbps * f, 4))

    @classmethod
    def full_scale(cls, reference: Reference = Reference()) -> Bandwidths:
        """The reference cluster's own bandwidths (simulated replicas scale them with their bytes)."""
        return cls(reference.nic_gbps, reference.disk_gbps, reference.host_gbps)


@dataclass(frozen=True)
class Design:
    """Everything the generated experiment file says."""

    model: Path
    tiny: dict[str, Any]  # make-tiny-model options when `model` is missing
    inactive: int
    phases: tuple[tuple[float, float], ...]  # (seconds, requests/s)
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    bandwidths: Bandwidths
    slo_ttft_ms: float
    slo_tpot_ms: float
    num_blocks: int | None = 512  # None: the engine's default (simulated: what the GPU's memory leaves)
    keep_alive: float = 5.0
    cooldown: float = 5.0
    router_args: tuple[str, ...] = ()  # more router flags, for every system
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    request_timeout: float = 300.0
    startup_timeout: float = 600.0
    name: str = "scaling"
    notes: dict[str, Any] = field(default_factory=dict)  # written as a comment (how it was sized)
    # torch: `model` is served; simulated: only its tokenizer is read
    engine: EngineSpec = field(default_factory=EngineSpec)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown:
            raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        if not 2 <= self.inactive <= 8:
            raise ValueError(f"--inactive must be 2..8, got {self.inactive}")

    @property
    def peak(self) -> tuple[int, int]:
        """(prefill, decode) of the static cluster provisioned for the peak: all 2 + N replicas,
        the odd one prefilling (prompts cost more than decode steps on these CPU replicas)."""
        extra = self.inactive
        return 1 + math.ceil(extra / 2), 1 + extra // 2

    def planner_args(self) -> list[str]:
        """Router flags of the scaled cluster's planner: it may grow to the peak's shape, and plans
        against the run's SLOs."""
        prefill, decode = self.peak
        return ["--max-prefill", str(prefill), "--max-decode", str(decode), "--keep-alive",
                f"{self.keep_alive:g}", "--cooldown", f"{self.cooldown:g}",
                "--ttft-slo", f"{self.slo_ttft_ms / 1000:g}", "--tpot-slo", f"{self.slo_tpot_ms / 1000:g}",
                *self.router_args]


def cluster_of(system: str) -> str:
    """The cluster a system runs on."""
    return {"host-cache": "burst-host-cache", PEAK: "peak"}.get(system, "burst")


def policy_of(system: str) -> str:
    """The router's --scaling policy of a system."""
    return "static" if system == PEAK else system


def burst_start(phases: tuple[tuple[float, float], ...]) -> float:
    """When the burst begins: the start of the busiest phase (the first, on a tie)."""
    from pdcluster.experiment.scaling.metrics import burst_window

    return burst_window(phases)[0]


def _toml(value: Any) -> str:
    """A TOML value: strings and lists as JSON writes them (valid TOML), tables inline."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def _engine_keys(engine: EngineSpec) -> list[str]:
    """[model]'s engine keys (none for torch, the default)."""
    if not engine.simulated:
        return []
    keys = {"engine": engine.kind, "gpu": engine.gpu, "model_card": engine.model_card,
            "byte_scale": engine.byte_scale, "compute_efficiency": engine.compute_efficiency,
            "memory_efficiency": engine.memory_efficiency}
    if engine.profile is not None:
        keys["profile"] = Path(engine.profile).resolve()
    return [f"{k} = {_toml(v)}" for k, v in keys.items()]


def experiment_toml(d: Design) -> str:
    """The experiment file of the design."""
    b = d.bandwidths
    replica_args = ["--disk-gbps", f"{b.disk_gbps:g}", "--host-gbps", f"{b.host_gbps:g}"]
    prefill, decode = d.peak
    lines = [f"# generated by `pdcluster bench scaling` ({json.dumps(d.notes)})" if d.notes else
             "# generated by `pdcluster bench scaling`",
             f"name = {_toml(d.name)}", f"strategies = [{_toml(STRATEGY)}]",
             f"policies = {_toml(sorted({policy_of(s) for s in d.systems}))}", 'matrix = "list"',
             f"seeds = [{d.seed}]", f"request_timeout = {d.request_timeout:g}",
             f"startup_timeout = {d.startup_timeout:g}", "",
             "[model]", f"path = {_toml(d.model)}", f"tiny = {_toml(d.tiny)}",
             *([f"num_blocks = {d.num_blocks}"] if d.num_blocks is not None else []), *_engine_keys(d.engine),
             "", "[slo]", f"ttft_ms = {d.slo_ttft_ms:g}", f"tpot_ms = {d.slo_tpot_ms:g}", ""]
    clusters = [("burst", 1, 1, d.inactive, d.planner_args(), replica_args),
                ("burst-host-cache", 1, 1, d.inactive, d.planner_args(), [*replica_args, "--host-cache"]),
                ("peak", prefill, decode, 0, list(d.router_args), replica_args)]
    used = {cluster_of(s) for s in d.systems}
    for name, p, dd, inactive, router, replica in clusters:
        if name in used:
            lines += ["[[clusters]]", f"name = {_toml(name)}", f"prefill = {p}", f"decode = {dd}",
                      f"inactive = {inactive}", f"router_args = {_toml(router)}",
                      f"replica_args = {_toml(replica)}", ""]
    lines += ["[[workloads]]", f"name = {_toml(WORKLOAD)}", 'arrival = "phases"',
              f"phases = {_toml([list(p) for p in d.phases])}", f"input_len = {_toml(list(d.input_len))}",
              f"output_len = {_toml(list(d.output_len))}", "",
              "[[topologies]]", f"name = {_toml(TOPOLOGY)}", 'backend = "pacing"']
    for i in range(2 + d.inactive):  # every replica its own node: each NIC paces what leaves it
        lines += ["[[topologies.nodes]]", f'name = "n{i}"', "replicas = 1", f"nic_gbps = {b.link_gbps:g}"]
    for system in d.systems:
        lines += ["", "[[cells]]", f"workload = {_toml(WORKLOAD)}", f"cluster = {_toml(cluster_of(system))}",
                  f"policy = {_toml(policy_of(system))}"]
    return "\n".join(lines) + "\n"
