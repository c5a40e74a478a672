"""Run one cell into its folder; a cell that fails or cannot run here is recorded, never raised.

```
 CELL/cell.json        the cell (system, workload, seed) and its fingerprint
      requests.jsonl   one line per request: arrival, send time, TTFT, every inter-token gap, E2E,
                       tokens in and out, the router's route (replicas, strategy, migration bytes and
                       seconds, re-runs)
      timeline.jsonl   the router's timeline (routers with --timeline)
      resources.jsonl  CPU, RSS of every process; KV pages, roles, queue from the router (every second)
      summary.json     TTFT/TPOT/ITL/E2EL stats, throughput, goodput, SLO attainment, migration
      logs/            every process's log
      network.json     kernel topology: the run id, namespaces and addresses
      status.json      written last: {"state": done | failed | skipped, "error", "fingerprint", ...}
```
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcluster.bench.serving.prompts import PromptMaker
from pdcluster.bench.serving.sender import model_vocab_size, probe, send_all, warm_up
from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.bench.serving.workload import Arrival
from pdcluster.experiment import netns
from pdcluster.experiment.cluster import CellCluster
from pdcluster.experiment.endpoint import Endpoint, skip_reason
from pdcluster.experiment.matrix import Cell, fingerprint
from pdcluster.experiment.sampler import Sampler, Watched
from pdcluster.experiment.spec import Experiment
from pdcluster.experiment.summary import cell_summary

STATUS = "status.json"
Progress = Callable[[int, int, float], None]
"""(requests done, requests in all, seconds the cell may still take: NaN while unknown)."""
Execute = Callable[[Experiment, Cell, Path, Progress | None], None]
"""Runs a cell into its folder (raises when it fails): processes here, or virtual time (pdcluster/sim)."""


@dataclass(frozen=True)
class Outcome:
    """How a cell ended."""

    state: str  # done | failed | skipped
    error: str = ""
    seconds: float = 0.0


def read_status(folder: Path) -> dict[str, Any]:
    """The cell's status.json ({} when it never finished writing one)."""
    try:
        return dict(json.loads((folder / STATUS).read_text()))
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a crash leaves the old file or none, never half of one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_cell(experiment: Experiment, cell: Cell, folder: Path, progress: Progress | None = None,
             execute: Execute | None = None) -> Outcome:
    """Run `cell` in a fresh `folder` (by `execute`: the cluster's processes by default); its status
    says how it ended."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stamp = fingerprint(cell, experiment)
    write_json(folder / "cell.json",
                {**cell.describe(), "fingerprint": stamp, "experiment": experiment.name})
    began = time.monotonic()
    reason = _skip_reason(cell) if execute is None else ""
    if reason:
        outcome = Outcome("skipped", reason)
    else:
        try:
            (execute or _run)(experiment, cell, folder, progress)
            outcome = Outcome("done")
        except Exception as exc:  # a failed cell is a result; the run goes on
            (folder / "error.txt").write_text(traceback.format_exc())
            outcome = Outcome("failed", f"{type(exc).__name__}: {exc}")
    outcome = Outcome(outcome.state, outcome.error, time.monotonic() - began)
    write_json(folder / STATUS, {"state": outcome.state, "error": outcome.error, "fingerprint": stamp,
                                  "seconds": round(outcome.seconds, 3), "finished": time.time()})
    return outcome


def _skip_reason(cell: Cell) -> str:
    if cell.endpoint is not None:
        return skip_reason(cell.endpoint)
    if cell.topology.backend == "kernel":
        return netns.unavailable(latency=any(n.latency_ms > 0 for n in cell.topology.nodes))
    return ""


def _run(experiment: Experiment, cell: Cell, folder: Path, progress: Progress | None) -> None:
    with contextlib.ExitStack() as stack:  # unwinds in reverse: the processes stop, then the network goes
        network = None
        if cell.topology.backend == "kernel":
            network = stack.enter_context(netns.Network(cell.topology.nodes))
            write_json(folder / "network.json", {
                "run_id": network.run_id, "head": network.head.namespace, "switch": network.switch,
                "nodes": {n.name: {"namespace": n.namespace, "address": n.address} for n in network.nodes}})
        system: CellCluster | Endpoint
        if cell.endpoint is not None:
            system = Endpoint(cell.endpoint, experiment.model.path, folder)
            stack.callback(system.stop)
            system.start()
        else:
            assert cell.cluster is not None
            system = CellCluster(experiment.model, cell.cluster, cell.strategy, cell.policy, cell.topology,
                                 folder, network)
            stack.callback(system.stop)
            system.start(experiment.startup_timeout)
        namespace = network.head.namespace if network else None
        watched = [Watched(p.name, p.popen.pid) for p in system.processes()]
        netns.in_namespace(namespace, lambda: _load(experiment, cell, folder, system.http_url, watched,
                                                    namespace, progress))


def _load(experiment: Experiment, cell: Cell, folder: Path, url: str, watched: list[Watched],
          namespace: str | None, progress: Progress | None) -> None:
    """Probe the server, build the workload, send it while sampling resources, write the results."""
    from pdcluster.experiment.workloads import arrivals as build

    max_len = cell.endpoint.max_model_len if cell.endpoint else 0
    served = probe(url, max_len, model_vocab_size(experiment.model.path))
    requests = build(cell.workload, cell.seed, served)
    maker = PromptMaker(cell.seed, served.vocab_size)
    prompts = maker.prompts(requests)
    # the first prompt's length, not its tokens: the first measured request must not find them cached
    warm = maker.warm_up_prompt(len(prompts[0]))
    asyncio.run(warm_up(url, served.model_id, warm, experiment.startup_timeout))
    t0, wall0 = time.perf_counter(), time.time()
    sampler = Sampler(folder / "resources.jsonl", watched, f"{url}/metrics" if cell.endpoint is None else "",
                      t0, (lambda: netns.enter(namespace)) if namespace else None)
    sampler.start()
    try:
        records, duration, _ = asyncio.run(send_all(url, served.model_id, requests, prompts,
                                                    experiment.request_timeout, _reporter(requests, progress),
                                                    start=t0))
    finally:
        sampler.stop()
    write_records(folder / "requests.jsonl", records)
    summary = cell_summary(records, duration, experiment.slo.limits(), requests)
    summary.update({"system": cell.system, "workload": cell.workload.name, "seed": cell.seed,
                    "model_id": served.model_id, "wall_start": wall0,
                    "max_total_tokens": served.max_total_tokens})
    write_json(folder / "summary.json", summary)


def _reporter(requests: list[Arrival], progress: Progress | None) -> Callable[[list[Any]], None] | None:
    if progress is None:
        return None
    last_arrival = max((a.at for a in requests), default=0.0)
    begun = time.monotonic()

    def report(tasks: list[Any]) -> None:
        done = [t.result() for t in tasks if t.done()]
        elapsed = time.monotonic() - begun
        # what is left to send, then a typical request's time (unknown before the first answer)
        typical = sum(r.latency for r in done) / len(done) if done else math.nan
        progress(len(done), len(tasks), max(0.0, last_arrival - elapsed) + typical)

    return report


def write_records(path: Path, records: list[RequestRecord]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            line = record.to_json()
            line["arrival"] = line.pop("scheduled")
            line["e2el"] = line.pop("latency")
            out.write(json.dumps(line) + "\n")
