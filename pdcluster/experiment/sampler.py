"""Resource samples of a running cell, every second, to `resources.jsonl`.

```
 {"t", "kind": "process", "name", "pids", "cpu_s", "cpu_percent", "rss_bytes"}   /proc of each started
                                                                               process and its children
 {"t", "kind": "replica", "replica", "role", "free_blocks", "used_blocks"}      the router's /metrics
 {"t", "kind": "queue", "depth", "prompt_tokens"}                               (pdcluster routers only)
```
`t` counts seconds from the load's start (the clock of the per-request records). The sampler thread
enters the router's network namespace (kernel topology backend) so /metrics is reachable.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Watched:
    """A process to sample, with every process below it."""

    name: str
    pid: int


def children_of() -> dict[int, list[int]]:
    """Parent pid → child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                tree.setdefault(int(stat[1]), []).append(int(entry.name))
    return tree


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1], utime [11])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def tree_usage(pid: int, tree: dict[int, list[int]]) -> tuple[list[int], float, int]:
    """(pids, CPU seconds, resident bytes) of `pid` and its descendants that are alive."""
    pids, stack, cpu, rss = [], [pid], 0.0, 0
    while stack:
        current = stack.pop()
        stat = _stat(current)
        if stat is None:
            continue
        pids.append(current)
        cpu += (int(stat[11]) + int(stat[12])) / _TICKS
        rss += int(stat[21]) * _PAGE
        stack.extend(tree.get(current, []))
    return pids, cpu, rss


def router_samples(metrics_text: str) -> list[dict[str, Any]]:
    """Replica roles, KV pages and the queue from a pdcluster router's Prometheus text."""
    replicas: dict[str, dict[str, Any]] = {}
    queue: dict[str, Any] = {"kind": "queue"}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            rid = sample.labels.get("replica")
            if sample.name == "pdcluster_replica_state" and sample.value == 1 and rid is not None:
                replicas.setdefault(rid, {})["role"] = sample.labels.get("role", "")
            elif sample.name == "pdcluster_replica_free_blocks" and rid is not None:
                replicas.setdefault(rid, {})["free_blocks"] = int(sample.value)
            elif sample.name == "pdcluster_replica_router_used_blocks" and rid is not None:
                replicas.setdefault(rid, {})["used_blocks"] = int(sample.value)
            elif sample.name == "pdcluster_queue_depth":  # one series per model: their sum
                queue["depth"] = queue.get("depth", 0) + int(sample.value)
            elif sample.name == "pdcluster_queue_prompt_tokens":
                queue["prompt_tokens"] = queue.get("prompt_tokens", 0) + int(sample.value)
    rows: list[dict[str, Any]] = [{"kind": "replica", "replica": rid, **values}
                                  for rid, values in sorted(replicas.items())]
    return [*rows, queue] if len(queue) > 1 else rows


class Sampler:
    """A thread writing one set of samples per `interval` until `stop()`."""

    def __init__(self, out: Path, watched: Iterable[Watched], metrics_url: str, t0: float,
                 enter: Callable[[], None] | None = None, interval: float = 1.0) -> None:
        self.out = out
        self.watched = list(watched)
        self.metrics_url = metrics_url
        self.t0 = t0
        self.enter = enter
        self.interval = interval
        self._stop = threading.Event()
        self._last: dict[str, tuple[float, float]] = {}
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def start(self) -> None:
        """Begin sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Take no more samples; returns once the file is closed."""
        self._stop.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        if self.enter is not None:
            self.enter()
        with self.out.open("w", encoding="utf-8") as out:
            while not self._stop.is_set():
                self._sample(out)
                self._stop.wait(self.interval)

    def _sample(self, out: IO[str]) -> None:
        now = time.perf_counter()
        t = round(now - self.t0, 3)
        tree = children_of()
        for watched in self.watched:
            pids, cpu, rss = tree_usage(watched.pid, tree)
            if not pids:
                continue
            last_t, last_cpu = self._last.get(watched.name, (now, cpu))
            percent = 100.0 * (cpu - last_cpu) / (now - last_t) if now > last_t else 0.0
            self._last[watched.name] = (now, cpu)
            out.write(json.dumps({"t": t, "kind": "process", "name": watched.name, "pids": pids,
                                  "cpu_s": round(cpu, 3), "cpu_percent": round(percent, 1),
                                  "rss_bytes": rss}) + "\n")
        for row in self._router(t):
            out.write(json.dumps(row) + "\n")
        out.flush()

    def _router(self, t: float) -> list[dict[str, Any]]:
        if not self.metrics_url:
            return []
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return []
        try:
            return [{"t": t, **row} for row in router_samples(text)]
        except ValueError:  # not Prometheus text (another server's /metrics)
            return []
