"""One experiment cell in virtual time: the same workload, the same files, no process and no sleep.

```
 cell (cluster shape with engine = "simulated", strategy, policy, topology, workload, seed)
   ─► VirtualCluster (cluster.py) on the loop's virtual clock (loop.py)
   ─► the workload's requests (experiment/workloads.py, the harness's own prompts)
   ─► client.py: submitted at their arrival times, timed per token
   ─► CELL/requests.jsonl, summary.json, timeline.jsonl (the harness's writers)
```
A cell of a torch cluster or an external endpoint cannot run in virtual time: it fails naming why.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pdcluster.bench.serving.prompts import PromptMaker
from pdcluster.bench.serving.sender import Served
from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.experiment.cell import Progress, write_json, write_records
from pdcluster.experiment.matrix import Cell
from pdcluster.experiment.spec import Experiment
from pdcluster.experiment.summary import cell_summary
from pdcluster.experiment.workloads import arrivals as build
from pdcluster.sim.client import send_all
from pdcluster.sim.cluster import VirtualCluster, VirtualShape
from pdcluster.sim.loop import run_virtual
from pdcluster.sim.network import RankPlace


def shape_of(experiment: Experiment, cell: Cell) -> VirtualShape:
    """The virtual cluster of a cell (ValueError for one that cannot be simulated)."""
    if cell.endpoint is not None or cell.cluster is None:
        raise ValueError("an external endpoint cannot run in virtual time")
    shape = cell.cluster
    if not shape.engine.simulated:
        raise ValueError(f"cluster {shape.name!r} runs the torch engine: give it engine = \"simulated\" "
                         "(a GPU and a model card) to run it in virtual time")
    roles = shape.roles()
    nodes = cell.topology.place(roles)
    places = []
    for node_index in nodes:
        node = cell.topology.nodes[node_index] if cell.topology.nodes else None
        places.append(RankPlace(node.name, node.nic_gbps, node.intra_gbps, node.host_models) if node
                      else RankPlace("n0"))
    return VirtualShape(tuple(roles), shape.engine, tuple(places), shape.replica_args, shape.router_args,
                        experiment.model.num_blocks)


def execute(experiment: Experiment, cell: Cell, folder: Path, progress: Progress | None = None) -> None:
    """Run `cell` in virtual time into `folder` (`experiment.cell.Execute`)."""
    began = time.monotonic()
    cluster = VirtualCluster(shape_of(experiment, cell), cell.strategy, cell.policy,
                             folder / "timeline.jsonl")
    with _fewer_collections():
        records, duration, served, requests = run_virtual(_run(experiment, cell, cluster, progress))
    write_records(folder / "requests.jsonl", records)
    summary = cell_summary(records, duration, experiment.slo.limits(), requests)
    wall = time.monotonic() - began
    summary.update({"system": cell.system, "workload": cell.workload.name, "seed": cell.seed,
                    "model_id": served.model_id, "max_total_tokens": served.max_total_tokens,
                    "virtual_time": True, "virtual_seconds": round(duration, 6)})
    write_json(folder / "summary.json", summary)
    write_json(folder / "simulation.json", {"wall_seconds": round(wall, 3), "virtual_seconds": duration,
                                            "requests": len(records), "replicas": len(cluster.replicas)})


async def _run(experiment: Experiment, cell: Cell, cluster: VirtualCluster, progress: Progress | None
               ) -> tuple[list[RequestRecord], float, Served, list]:
    scheduler = await cluster.start()
    try:
        served = _served(cluster)
        requests = build(cell.workload, cell.seed, served)
        prompts = PromptMaker(cell.seed, served.vocab_size).prompts(requests)
        records, duration = await send_all(scheduler, requests, prompts, experiment.request_timeout,
                                           _reporter(len(requests), progress), cluster.fronts or None)
    finally:
        await cluster.stop()
    return records, duration, served, requests


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """The cluster built so far stays out of the cycle collector's scans, and it runs less often: a
    run keeps millions of objects alive (requests, replicas' pages, timers), and the default
    thresholds rescan them all again and again."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _served(cluster: VirtualCluster) -> Served:
    """What the router's /info would say: the card's limits and vocabulary."""
    engine = cluster.replicas[0].engine
    limits = engine.limits
    return Served(engine.meta.model_id, limits.max_input_tokens, limits.max_total_tokens, limits.vocab_size)


def _reporter(total: int, progress: Progress | None) -> Callable[[int], None] | None:
    if progress is None:
        return None
    step = max(1, total // 100)

    def report(done: int) -> None:
        if done % step == 0 or done == total:
            progress(done, total, math.nan)

    return report
