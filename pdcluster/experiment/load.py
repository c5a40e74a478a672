"""Read an experiment file (TOML) into an `Experiment`, refusing anything it does not understand.

Every table is read through a `Table` that hands out its keys with their types checked and, at the
end, names every key nobody asked for: a misspelt option is an error (`ExperimentError`, naming the
file, the table and the key), never silently ignored. Relative paths are relative to the file's
folder. `examples/experiment-demo.toml` shows every table.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pdcluster.bench.serving.traces import FORMATS
from pdcluster.cluster.engine import ENGINES, EngineSpec
from pdcluster.experiment.spec import (
    ARRIVALS,
    BACKENDS,
    LOCAL,
    ROLES,
    STATIC_POLICY,
    CellChoice,
    ClusterShape,
    EndpointSpec,
    Experiment,
    LengthSpec,
    ModelSpec,
    NodeSpec,
    Slo,
    TopologySpec,
    WorkloadSpec,
)

T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")  # @: a workload of a rate sweep (chat@4)


_NEED_0 = "must be >= 0"


def _at_least_0(value: float) -> bool:
    return value >= 0


class ExperimentError(ValueError):
    """The experiment file is malformed; the message names the file and the place."""


class Table:
    """One TOML table being read: typed getters, then `done()` refuses the keys left over."""

    def __init__(self, data: Any, where: str, file: Path) -> None:
        if not isinstance(data, dict):
            raise ExperimentError(f"{file}: {where} must be a table")
        self.data = dict(data)
        self.where = where
        self.file = file

    def fail(self, message: str) -> ExperimentError:
        """An error about this table."""
        return ExperimentError(f"{self.file}: {self.where}: {message}")

    def get(self, key: str, kind: type[T] | tuple[type, ...], default: Any = ..., check: Callable[[Any], bool]
            | None = None, need: str = "") -> Any:
        """The value of `key` (of type `kind`), or `default` when absent (required without one)."""
        if key not in self.data:
            if default is ...:
                raise self.fail(f"missing key {key!r}")
            return default
        value = self.data.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(f"{key} = {value!r} must be {names}")
        if check is not None and not check(value):
            raise self.fail(f"{key} = {value!r} {need or 'is out of range'}")
        return value

    def names(self, key: str, default: Any = ...) -> tuple[str, ...]:
        """A list of names (strings)."""
        value = self.get(key, list, default)
        if not all(isinstance(v, str) and _NAME.match(v) for v in value):
            raise self.fail(f"{key} must be a list of names (letters, digits, '.', '_', '-', '@'), "
                            f"got {value!r}")
        return tuple(value)

    def tables(self, key: str) -> list[Table]:
        """An array of tables (`[[key]]`), each to be read in turn."""
        items = self.get(key, list, [])
        prefix = "" if self.where == "top level" else f"{self.where}."
        return [Table(item, f"{prefix}{key}[{i}]", self.file) for i, item in enumerate(items)]

    def path(self, key: str, default: Any = ...) -> Path | None:
        """A path, relative to the experiment file's folder."""
        value = self.get(key, str, default)
        return None if value is None else (self.file.parent / value).resolve()

    def done(self) -> None:
        """Refuse the keys nobody read."""
        if self.data:
            raise self.fail(f"unknown key(s) {', '.join(sorted(self.data))}")


def load_experiment(path: Path) -> Experiment:
    """Read and check the experiment file at `path`."""
    path = Path(path).resolve()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ExperimentError(f"{path}: cannot read ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentError(f"{path}: not valid TOML ({exc})") from exc
    top = Table(data, "top level", path)
    experiment = _experiment(top, path)
    top.done()
    _check_matrix(experiment, top)
    return experiment


def _experiment(top: Table, path: Path) -> Experiment:
    name = top.get("name", str, path.stem)
    repetitions = top.get("repetitions", int, 1, lambda v: v >= 1, "must be >= 1")
    seeds = tuple(top.get("seeds", list, list(range(repetitions))))
    if len(seeds) != repetitions or not all(isinstance(s, int) for s in seeds):
        raise top.fail(f"seeds must be {repetitions} integers (one per repetition), got {list(seeds)}")
    matrix = top.get("matrix", str, "product", lambda v: v in ("product", "list"), "must be product or list")
    cells = tuple(_cell(t) for t in top.tables("cells"))
    if matrix == "list" and not cells:
        raise top.fail('matrix = "list" needs [[cells]]')
    if matrix == "product" and cells:
        raise top.fail('[[cells]] needs matrix = "list"')
    workloads = tuple(w for t in top.tables("workloads") for w in _workloads(t))
    model = _model(Table(top.get("model", dict), "model", path))
    return Experiment(
        name=name, source=path, model=model,
        clusters=tuple(_cluster(t, model.engine) for t in top.tables("clusters")),
        strategies=top.names("strategies", []), policies=top.names("policies", [STATIC_POLICY]),
        workloads=workloads, topologies=tuple(_topology(t) for t in top.tables("topologies")) or (LOCAL,),
        endpoints=tuple(_endpoint(t) for t in top.tables("endpoints")),
        slo=_slo(Table(top.get("slo", dict, {}), "slo", path)), seeds=seeds, cells=cells,
        request_timeout=top.get("request_timeout", float, 300.0, lambda v: v > 0, "must be > 0"),
        startup_timeout=top.get("startup_timeout", float, 300.0, lambda v: v > 0, "must be > 0"),
    )


def _model(t: Table) -> ModelSpec:
    spec = ModelSpec(path=t.path("path"), tiny=dict(t.get("tiny", dict, {})),  # type: ignore[arg-type]
                     num_blocks=t.get("num_blocks", int, None, lambda v: v > 0, "must be > 0"),
                     torch_threads=t.get("torch_threads", int, 0, lambda v: v >= 0, "must be >= 0"),
                     engine=_engine(t, EngineSpec()))
    t.done()
    return spec


def _engine(t: Table, base: EngineSpec) -> EngineSpec:
    """`engine`, `gpu`, `model_card`, `byte_scale`, `profile`, `compute_efficiency`, `memory_efficiency`
    over `base` (a cluster's over the [model] ones)."""
    fraction = (float, str)
    try:
        return EngineSpec(
            kind=t.get("engine", str, base.kind, lambda v: v in ENGINES, f"must be one of {ENGINES}"),
            gpu=t.get("gpu", str, base.gpu), model_card=t.get("model_card", str, base.model_card),
            byte_scale=str(t.get("byte_scale", fraction, base.byte_scale)),
            profile=t.path("profile", base.profile),
            compute_efficiency=t.get("compute_efficiency", float, base.compute_efficiency),
            memory_efficiency=t.get("memory_efficiency", float, base.memory_efficiency),
        )
    except ValueError as exc:
        raise t.fail(str(exc)) from None


def _cluster(t: Table, engine: EngineSpec) -> ClusterShape:
    shape = ClusterShape(t.get("name", str, check=lambda v: bool(_NAME.match(v)), need="is not a name"),
                         t.get("prefill", int, 1, _at_least_0, _NEED_0),
                         t.get("decode", int, 1, _at_least_0, _NEED_0),
                         t.get("inactive", int, 0, _at_least_0, _NEED_0),
                         _strings(t, "router_args"), _strings(t, "replica_args"), _engine(t, engine))
    t.done()
    if shape.prefill + shape.decode < 1:
        raise t.fail("a cluster needs at least one prefill or decode replica")
    return shape


def _strings(t: Table, key: str) -> tuple[str, ...]:
    value = t.get(key, list, [])
    if not all(isinstance(v, str) for v in value):
        raise t.fail(f"{key} must be a list of strings (command-line words), got {value!r}")
    return tuple(value)


def _lengths(t: Table, key: str, default: int) -> LengthSpec:
    value = t.get(key, (int, list), default)
    if isinstance(value, int):
        value = [value, value]
    if len(value) != 2 or not all(isinstance(v, int) and v >= 1 for v in value) or value[0] > value[1]:
        raise t.fail(f"{key} must be a token count >= 1 or [low, high] with 1 <= low <= high, got {value!r}")
    return LengthSpec(value[0], value[1])


def _rates(t: Table, arrival: str) -> list[float]:
    """`rate` or `rates`: numbers, or "inf" (all at once); a trace's 0 keeps its own pace."""
    if "rate" in t.data and "rates" in t.data:
        raise t.fail("give rate or rates, not both")
    if "rates" in t.data:
        raw = t.get("rates", list)
    else:  # a trace keeps its own pace without a rate; synthetic arrivals need one
        raw = [t.get("rate", (float, str), 0.0 if arrival == "trace" else ...)]
    rates = []
    for value in raw:
        rate = math.inf if value == "inf" else value
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not (rate > 0 or (
                arrival == "trace" and rate == 0)):
            raise t.fail(f"rate {value!r} must be a positive number or \"inf\"")
        rates.append(float(rate))
    if not rates:
        raise t.fail("rates is empty")
    return rates


def _workloads(t: Table) -> list[WorkloadSpec]:
    name = t.get("name", str, check=lambda v: bool(_NAME.match(v)) and "@" not in v, need="is not a name")
    arrival = t.get("arrival", str, "poisson", lambda v: v in ARRIVALS, f"must be one of {ARRIVALS}")
    sweep = "rates" in t.data  # a rate sweep: each workload is named name@rate
    phases = _phases(t, arrival)
    rates = [_mean_rate(phases)] if phases else _rates(t, arrival)
    common: dict[str, Any] = {
        "arrival": arrival, "phases": phases,
        "num": t.get("num", int, 0 if arrival in ("trace", "phases") else ..., lambda v: v >= 0,
                     "must be >= 0"),
        "cv": t.get("cv", float, 1.0, lambda v: v >= 0, "must be >= 0"),
        "input_len": _lengths(t, "input_len", 128), "output_len": _lengths(t, "output_len", 32),
        "lengths_from": t.path("lengths_from", None),
        "trace": t.path("trace", None) if arrival == "trace" else None,
        "format": t.get("format", str, "", lambda v: v in ("", *FORMATS), f"must be one of {FORMATS}"),
        "speed": t.get("speed", float, 1.0, lambda v: v > 0, "must be > 0"),
        "max_input_len": t.get("max_input_len", int, 0, lambda v: v >= 0, "must be >= 0"),
        "max_output_len": t.get("max_output_len", int, 0, lambda v: v >= 0, "must be >= 0"),
        "models": tuple(t.get("models", list, [], lambda v: all(isinstance(m, str) and m for m in v),
                              "must be a list of model names")),
    }
    window = t.get("window", list, None)
    if window is not None:
        numbers = len(window) == 2 and all(isinstance(w, int | float) for w in window)
        if not numbers or not window[0] < window[1]:
            raise t.fail(f"window must be [start, end] seconds with start < end, got {window!r}")
        common["window"] = (float(window[0]), float(window[1]))
    t.done()
    if arrival == "trace" and common["trace"] is None:
        raise t.fail('arrival = "trace" needs trace = "FILE"')
    if arrival not in ("trace", "phases") and common["num"] < 1:
        raise t.fail("num must be >= 1")
    if arrival == "gamma" and common["cv"] == 0:
        raise t.fail("a gamma workload needs cv > 0")
    return [WorkloadSpec(name=f"{name}@{_rate_text(r)}" if sweep else name, rate=r, **common) for r in rates]


def _phases(t: Table, arrival: str) -> tuple[tuple[float, float], ...]:
    """`phases = [[seconds, rate], …]` of a phases workload (rate and rates are refused beside it)."""
    if arrival != "phases":
        if "phases" in t.data:
            raise t.fail('phases needs arrival = "phases"')
        return ()
    if "rate" in t.data or "rates" in t.data:
        raise t.fail("a phases workload takes its rates from phases, not rate or rates")
    raw = t.get("phases", list)
    phases = []
    for item in raw:
        numbers = isinstance(item, list) and len(item) == 2 and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in item)
        if not numbers or not (item[0] > 0 and item[1] >= 0):
            raise t.fail(f"phases must be [[seconds, rate], …] with seconds > 0 and rate >= 0 "
                         f"(requests/s), got {item!r}")
        phases.append((float(item[0]), float(item[1])))
    if not any(rate > 0 for _, rate in phases):
        raise t.fail(f"phases need one phase with a rate > 0, got {raw!r}")
    return tuple(phases)


def _mean_rate(phases: tuple[tuple[float, float], ...]) -> float:
    """The requests/s a phases workload offers on average (its `rate`, for the report's axes)."""
    return sum(seconds * rate for seconds, rate in phases) / sum(seconds for seconds, _ in phases)


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _topology(t: Table) -> TopologySpec:
    name = t.get("name", str, check=lambda v: bool(_NAME.match(v)), need="is not a name")
    backend = t.get("backend", str, "pacing", lambda v: v in BACKENDS, f"must be one of {BACKENDS}")
    nodes = tuple(_node(n) for n in t.tables("nodes"))
    t.done()
    if not nodes:
        raise t.fail("a topology needs [[topologies.nodes]]")
    mixed = {isinstance(n.replicas, int) for n in nodes}
    if len(mixed) > 1:
        raise t.fail("give every node a replica count, or every node a list of roles, not both")
    if backend == "pacing" and any(n.intra_gbps or n.latency_ms for n in nodes):
        raise t.fail('intra_gbps and latency_ms need backend = "kernel" (the fabric paces NICs only)')
    return TopologySpec(name, backend, nodes)


def _node(t: Table) -> NodeSpec:
    replicas = t.get("replicas", (int, list))
    if isinstance(replicas, list):
        if not all(r in ROLES for r in replicas):
            raise t.fail(f"replicas must name roles out of {ROLES}, got {replicas!r}")
        replicas = tuple(replicas)
    elif replicas < 0:
        raise t.fail("replicas must be >= 0")
    node = NodeSpec(t.get("name", str, check=lambda v: bool(_NAME.match(v)), need="is not a name"), replicas,
                    t.get("nic_gbps", float, 0.0, _at_least_0, _NEED_0),
                    t.get("intra_gbps", float, 0.0, _at_least_0, _NEED_0),
                    t.get("latency_ms", float, 0.0, _at_least_0, _NEED_0),
                    tuple(t.get("host_models", list, [], lambda v: all(isinstance(m, str) and m for m in v),
                                "must be a list of model names")))
    t.done()
    return node


def _endpoint(t: Table) -> EndpointSpec:
    launch = t.get("launch", list, [])
    requires = t.get("requires", list, [])
    env = t.get("env", dict, {})
    if not all(isinstance(a, str) for a in [*launch, *requires, *env.values()]):
        raise t.fail("launch, requires and env values must be strings")
    spec = EndpointSpec(
        name=t.get("name", str, check=lambda v: bool(_NAME.match(v)), need="is not a name"),
        url=t.get("url", str, check=lambda v: v.startswith(("http://", "https://")),
                  need="is not an http URL"),
        launch=tuple(launch), requires=tuple(requires), env=dict(env),
        ready_timeout=t.get("ready_timeout", float, 900.0, lambda v: v > 0, "must be > 0"),
        max_model_len=t.get("max_model_len", int, 0, lambda v: v >= 0, "must be >= 0"),
        workloads=t.names("workloads", []))
    t.done()
    return spec


def _slo(t: Table) -> Slo:
    def limit(key: str) -> float:
        return t.get(key, float, 0.0, lambda v: v > 0, "must be a positive number of milliseconds")

    slo = Slo(limit("ttft_ms"), limit("tpot_ms"), limit("e2el_ms"))
    t.done()
    return slo


def _cell(t: Table) -> CellChoice:
    keys = ("cluster", "strategy", "policy", "topology", "endpoint")
    choice = CellChoice(t.get("workload", str), **{k: t.get(k, str, "") for k in keys})
    t.done()
    if choice.endpoint and (choice.cluster or choice.strategy or choice.topology):
        raise t.fail("a cell runs an endpoint or a local cluster, not both")
    return choice


def _check_matrix(e: Experiment, top: Table) -> None:
    """Names unique, references resolvable, and at least one cell to run."""
    for kind, items in (("cluster", e.clusters), ("workload", e.workloads), ("topology", e.topologies),
                        ("endpoint", e.endpoints)):
        names = [i.name for i in items]
        if len(set(names)) != len(names):
            raise top.fail(f"two {kind}s share a name: {names}")
    if not e.workloads:
        raise top.fail("the matrix is empty: no [[workloads]]")
    local = bool(e.clusters and e.strategies and e.policies)
    if not e.cells and not local and not e.endpoints:
        missing = [k for k, v in (("[[clusters]]", e.clusters), ("strategies", e.strategies),
                                  ("policies", e.policies)) if not v]
        raise top.fail(f"the matrix is empty: no [[endpoints]], and no local cells for want of "
                       f"{', '.join(missing)}")
    for topology in e.topologies:
        for shape in e.clusters:
            try:
                topology.place(shape.roles())
            except ValueError as exc:
                if not e.cells:
                    raise top.fail(str(exc)) from None
