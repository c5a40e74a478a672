"""The experiment's cells: the cartesian product of its parts, or its explicit list (pure).

    local cells:    clusters × strategies × policies × topologies × workloads × seeds
    endpoint cells: endpoints × workloads × seeds

Each cell has a folder name (`key`) made of its parts' names and a fingerprint of everything that
decides its result: a finished cell is not run again while its fingerprint is the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import Any

from pdcluster.experiment.spec import (
    LOCAL,
    CellChoice,
    ClusterShape,
    EndpointSpec,
    Experiment,
    TopologySpec,
    WorkloadSpec,
)

_UNSAFE = re.compile(r"[^A-Za-z0-9._@-]+")


@dataclass(frozen=True)
class Cell:
    """One run: a system (a local cluster with a strategy and policy on a topology, or an endpoint),
    one workload, one seed."""

    workload: WorkloadSpec
    seed: int
    rep: int
    cluster: ClusterShape | None = None
    strategy: str = ""
    policy: str = ""
    topology: TopologySpec = LOCAL
    endpoint: EndpointSpec | None = None

    @property
    def system(self) -> str:
        """What was measured, without the workload: `1p1d/full/static@local` or `vllm`."""
        if self.endpoint is not None:
            return self.endpoint.name
        assert self.cluster is not None
        return f"{self.cluster.name}/{self.strategy}/{self.policy}@{self.topology.name}"

    @property
    def key(self) -> str:
        """The cell's folder name."""
        return _UNSAFE.sub("-", f"{self.system.replace('/', '.')}__{self.workload.name}__r{self.rep}")

    def describe(self) -> dict[str, Any]:
        """The cell as JSON (written to `cell.json`)."""
        data = asdict(self)
        data["system"], data["key"] = self.system, self.key
        return _jsonable(data)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "inf"
    return value


def fingerprint(cell: Cell, experiment: Experiment) -> str:
    """A hash of what decides the cell's result: the cell, the model, SLOs and timeouts."""
    basis = {"cell": cell.describe(), "model": _jsonable(asdict(experiment.model)),
             "slo": asdict(experiment.slo), "timeout": experiment.request_timeout}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def expand(experiment: Experiment) -> list[Cell]:
    """Every cell of the experiment, in run order (seeds innermost, so repetitions sit together)."""
    e = experiment
    reps = list(enumerate(e.seeds))
    if e.cells:
        cells = [cell for choice in e.cells for cell in _chosen(e, choice, reps)]
    else:
        cells = [
            Cell(workload, seed, rep, cluster, strategy, policy, topology)
            for cluster, strategy, policy, topology, workload, (rep, seed) in product(
                e.clusters, e.strategies, e.policies, e.topologies, e.workloads, reps)
        ]
        cells += [Cell(workload, seed, rep, endpoint=endpoint)
                  for endpoint, workload, (rep, seed) in product(e.endpoints, e.workloads, reps)
                  if not endpoint.workloads or {workload.name, workload.family} & set(endpoint.workloads)]
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise ValueError("two cells of the matrix are the same (a [[cells]] entry given twice?)")
    if not cells:
        raise ValueError("the matrix is empty")
    return cells


def _one(items: tuple[Any, ...], name: str, kind: str) -> Any:
    """The item called `name`, or the only one when `name` is empty."""
    if not name:
        if len(items) != 1:
            raise ValueError(f"a [[cells]] entry must name its {kind} (there are {len(items)})")
        return items[0]
    for item in items:
        if (item if isinstance(item, str) else item.name) == name:
            return item
    raise ValueError(f"a [[cells]] entry names {kind} {name!r}, which the file does not define")


def _chosen(e: Experiment, choice: CellChoice, reps: list[tuple[int, int]]) -> list[Cell]:
    workloads = [w for w in e.workloads if choice.workload in (w.name, w.family)]
    if not workloads:
        raise ValueError(f"a [[cells]] entry names workload {choice.workload!r}, which the file does not "
                         "define")
    if choice.endpoint:
        endpoint = _one(e.endpoints, choice.endpoint, "endpoint")
        return [Cell(w, seed, rep, endpoint=endpoint) for w in workloads for rep, seed in reps]
    cluster = _one(e.clusters, choice.cluster, "cluster")
    strategy = _one(e.strategies, choice.strategy, "strategy")
    policy = _one(e.policies, choice.policy, "policy")
    topology = _one(e.topologies, choice.topology, "topology")
    topology.place(cluster.roles())  # ValueError when the nodes do not fit this cluster
    return [Cell(w, seed, rep, cluster, strategy, policy, topology) for w in workloads for rep, seed in reps]
