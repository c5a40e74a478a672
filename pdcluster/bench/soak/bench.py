"""`pdcluster bench soak`: a local cluster served for `--minutes` under everything at once, then judged.

```
 LocalCluster (P prefill + D decode, admin token)
   ├─ clients x --clients (traffic.py): both APIs, streamed or not, sampling, stops, hang-ups, malformed
   ├─ admin_loop (churn.py): strategy flips + Stats every ~2 s, a decode replica drained and restored
   ├─ kill_loop  (churn.py): replica --kill-rank SIGKILLed every --kill-every s, restarted (same rank/port)
   └─ sample_loop (sampler.py): RSS, fds, threads of every process (+ children), free KV pages, every
                                --sample-every s
 then: traffic stops; every replica must get all its pages back; verdict.py fits each long-lived
 process's series over the second half; JSON (--json) + PNG (--plot) of the curves
```
It fails (exit 1) when a series grows without bound (verdict.py states the limits and why), a
request fails other than while a kill explains it (in flight between the kill and `KILL_GRACE_S`
after the restart served again), an admin call answers UNKNOWN/INTERNAL, a process that was not
killed exits, or a replica keeps pages after the traffic stopped.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.bench.serving.sender import model_vocab_size, probe
from pdcluster.bench.soak.churn import Admin, ChurnLog, Kill, admin_loop, kill_loop
from pdcluster.bench.soak.plot import plot
from pdcluster.bench.soak.sampler import Samples, free_pages, sample_loop
from pdcluster.bench.soak.traffic import Outcome, client_loop
from pdcluster.bench.soak.verdict import LIMITS, Point, Trend, trend
from pdcluster.cluster.local import LocalCluster, UpConfig
from protos import router_pb2

TOKEN = "soak-admin-token"
KILL_GRACE_S = 15.0  # the router polls a dead replica every second and takes it back once it answers
DRAIN_S = 60.0


@dataclass
class BenchSoakConfig:
    """Options of `pdcluster bench soak`."""

    model: Path = field(metadata={"help": "checkpoint folder (e.g. from `pdcluster make-tiny-model`)"})
    minutes: float = field(default=30.0, metadata={"help": "how long the traffic runs"})
    prefill: int = field(default=1, metadata={"help": "prefill replicas"})
    decode: int = field(default=2, metadata={"help": "decode replicas"})
    clients: int = field(default=6, metadata={"help": "concurrent clients, each one request at a time"})
    num_blocks: int = field(default=128, metadata={"help": "KV pages per replica"})
    sample_every: float = field(default=10.0, metadata={"help": "seconds between resource samples"})
    kill_every: float = field(default=180.0, metadata={"help": "seconds between replica kills (0 = none)"})
    down_for: float = field(default=5.0, metadata={"help": "seconds a killed replica stays down"})
    kill_rank: int = field(default=-1, metadata={"help": "rank killed (-1 = the last replica)"})
    drain_every: float = field(default=30.0, metadata={"help": "seconds between drain/restore rounds"})
    seed: int = field(default=0, metadata={"help": "seed of the traffic and churn"})
    json: Path | None = field(default=None, metadata={"help": "report JSON file"})
    plot: Path | None = field(default=None, metadata={"help": "PNG of the curves (default: beside --json)"})
    log_dir: Path | None = field(default=None, metadata={"help": "process logs (unset: a temp folder)"})

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.minutes <= 0 or self.sample_every <= 0 or self.clients < 1:
            raise ValueError("--minutes, --sample-every and --clients must be positive")
        replicas = self.prefill + self.decode
        if not -replicas <= self.kill_rank < replicas:
            raise ValueError(f"--kill-rank {self.kill_rank} is not a rank of {replicas} replicas")
        if self.kill_every and replicas < 2:
            raise ValueError("killing the only replica leaves nothing to serve: use --kill-every 0")


def run(config: BenchSoakConfig) -> int:
    """CLI runner: soak, judge, write JSON and PNG, print the verdict."""
    up = UpConfig(model=config.model, prefill=config.prefill, decode=config.decode, http_port=0,
                  admin_port=0, num_blocks=config.num_blocks, admin_token=TOKEN, log_dir=config.log_dir)
    cluster = LocalCluster(up)
    print(f"bench soak: local cluster starting, logs in {cluster.log_dir}", file=sys.stderr, flush=True)
    with cluster:
        report = soak(config, cluster)
    _write(config, report)
    _print(report)
    return 0 if report["passed"] else 1


def soak(config: BenchSoakConfig, cluster: LocalCluster) -> dict[str, Any]:
    """Run the soak on a started cluster; the report (plain JSON data)."""
    rank = config.kill_rank % len(cluster.replicas)
    pids = {p.name: p.popen.pid for p in [cluster.router, *cluster.replicas] if p is not None}
    admin = Admin(cluster.admin_address, TOKEN)
    churn, outcomes = ChurnLog(), list[Outcome]()
    t0 = time.monotonic()
    samples = Samples(t0)
    until = t0 + config.minutes * 60
    try:
        asyncio.run(_traffic(config, cluster, admin, churn, outcomes, samples, until, rank))
        pages = _wait_pages_back(cluster)
        stats = admin.stub.Stats(router_pb2.StatsRequest(), timeout=30)
    finally:
        admin.close()
    killed = cluster.replicas[rank].name
    exited = [name for name, pid in pids.items()
              if name != killed and _current_pid(cluster, name) != pid]
    return _report(config, t0, samples, outcomes, churn, pages, exited, killed, stats)


async def _traffic(config: BenchSoakConfig, cluster: LocalCluster, admin: Admin, churn: ChurnLog,
                   outcomes: list[Outcome], samples: Samples, until: float, rank: int) -> None:
    model = cluster.config.model.name
    # the served model's vocabulary (the router's /info, else the checkpoint's config.json)
    vocab = (await asyncio.to_thread(probe, cluster.http_url, 1, model_vocab_size(config.model))).vocab_size
    tasks = [client_loop(cluster.http_url, model, vocab, config.seed * 1000 + i, until, outcomes)
             for i in range(config.clients)]
    tasks.append(admin_loop(admin, churn, config.seed, until, rank, drain_every=config.drain_every))
    tasks.append(sample_loop(cluster, samples, until, config.sample_every))
    if config.kill_every:
        tasks.append(kill_loop(cluster, churn, rank, until, config.kill_every, config.down_for))
    await asyncio.gather(*tasks)


def _current_pid(cluster: LocalCluster, name: str) -> int | None:
    procs = [p for p in [cluster.router, *cluster.replicas] if p is not None and p.name == name]
    alive = [p for p in procs if p.popen.poll() is None]
    return alive[0].popen.pid if alive else None


def _wait_pages_back(cluster: LocalCluster) -> dict[str, tuple[int, int] | None]:
    """Every replica's (free, total) once all are free, or as they are after `DRAIN_S`."""
    end = time.monotonic() + DRAIN_S
    while True:
        pages = {p.name: free_pages(p.address) for p in cluster.replicas}
        if all(v is not None and v[0] == v[1] for v in pages.values()) or time.monotonic() > end:
            return pages
        time.sleep(0.5)


def _explained(o: Outcome, kills: list[Kill]) -> bool:
    """The request was in flight while a killed replica was down or just back."""
    return any(o.end >= k.killed and o.start <= (k.back or o.end) + KILL_GRACE_S for k in kills)


def _trends(samples: Samples, window: tuple[float, float]) -> list[Trend]:
    lives: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in samples.usage:
        lives[(row["process"], row["pid"])].append(row)
    return [trend(name, pid, metric, [Point(r["t"], r[metric]) for r in rows], window)
            for (name, pid), rows in sorted(lives.items()) for metric in LIMITS]


def _report(config: BenchSoakConfig, t0: float, samples: Samples, outcomes: list[Outcome], churn: ChurnLog,
            pages: dict[str, tuple[int, int] | None], exited: list[str], killed: str, stats: Any
            ) -> dict[str, Any]:
    duration = config.minutes * 60
    window = (duration / 2, duration)
    trends = _trends(samples, window)
    failed = [o for o in outcomes if o.outcome == "failed"]
    unexplained = [o for o in failed if not _explained(o, churn.kills)]
    leaked = {name: v for name, v in pages.items() if v is None or v[0] != v[1]}
    counts: dict[str, int] = defaultdict(int)
    for o in outcomes:
        counts[o.outcome] += 1
    problems = [f"{t.process} (pid {t.pid}) {t.metric} grew {t.slope_per_min:+.3g}/min" for t in trends
                if t.grew]
    problems += [f"request failed: {o.kind}: {o.detail}" for o in unexplained]
    problems += [f"admin: {d}" for d in churn.defects]
    problems += [f"{name} exited (never killed)" for name in exited]
    problems += [f"{name} kept pages after the traffic stopped: {v}" for name, v in leaked.items()]

    def rel(t: float) -> float:
        return round(t - t0, 3)

    return {
        "bench": "soak", "minutes": config.minutes, "passed": not problems, "problems": problems,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
        "window_s": list(window), "killed_process": killed,
        "requests": dict(counts), "requests_total": len(outcomes),
        "failed_explained_by_kills": len(failed) - len(unexplained),
        "failures": [{**o.to_json(), "start": rel(o.start), "end": rel(o.end)} for o in failed],
        "kills": [{"rank": k.rank, "killed_s": rel(k.killed), "back_s": rel(k.back) if k.back else None}
                  for k in churn.kills],
        "admin_calls": dict(churn.calls),
        "router_stats": {name: getattr(stats, name) for name in (
            "requests_finished", "requests_failed", "requests_cancelled", "requests_requeued", "migrations",
            "generated_tokens")},
        "pages_after": {name: list(v) if v else None for name, v in pages.items()},
        "limits": {m: vars(limit) for m, limit in LIMITS.items()},
        "trends": [t.to_json() for t in trends],
        "samples": {"usage": samples.usage, "pages": samples.pages},
    }


def _write(config: BenchSoakConfig, report: dict[str, Any]) -> None:
    png = config.plot or (config.json.with_suffix(".png") if config.json else None)
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(report, png)
        report["plot"] = str(png)
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(report, indent=1) + "\n")


def _print(report: dict[str, Any]) -> None:
    judged = [t for t in report["trends"] if t["judged"]]
    print(f"soak {report['minutes']:g} min: {'PASS' if report['passed'] else 'FAIL'}")
    print(f"  requests {report['requests_total']}: {report['requests']} "
          f"({report['failed_explained_by_kills']} failures explained by kills)")
    print(f"  kills {len(report['kills'])}, admin calls {sum(report['admin_calls'].values())}, "
          f"router stats {report['router_stats']}")
    for t in judged:
        print(f"  {t['process']:<28} {t['metric']:<8} slope {t['slope_per_min']:+9.3f}/min "
              f"({t['points']} samples){'  GREW' if t['grew'] else ''}")
    for problem in report["problems"]:
        print(f"  problem: {problem}")
    if "plot" in report:
        print(f"  curves: {report['plot']}")
