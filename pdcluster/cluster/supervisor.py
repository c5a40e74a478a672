"""The run loop of `pdcluster up` and `pdcluster launch`: start, serve, restart what dies, give up
when the cluster cannot come back, stop everything.

```
 start() ─► ready line ─► every 0.5 s:  router ended?                  ─► stop, exit 1
                                        a replica ended ─► lost()?     ─► stop, exit 1 (allocation gone, …)
                                                        ─► budget left? ─► restart after a backoff
                                                                          (same rank, ports, device)
                                                        ─► spent        ─► stop, exit 1
                         Ctrl-C / SIGTERM ───────────────────────────────► stop, exit 0
```
A restarted replica listens on the address the router knows: the router polls a replica it
declared dead and takes it back when it answers (router/README.md, Failures).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

from pdcluster.cluster.processes import Proc


class Interrupted(Exception):
    """Ctrl-C / SIGTERM while the cluster was starting."""


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` restarts of one replica within `window_s`; each after a doubling backoff."""

    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def recent(self, restarts: list[float], now: float) -> int:
        """Restarts within the window."""
        return sum(1 for t in restarts if now - t < self.window_s)

    def allows(self, restarts: list[float], now: float) -> bool:
        """Whether one more restart fits the budget."""
        return self.recent(restarts, now) < self.max_restarts

    def delay(self, restarts: list[float], now: float) -> float:
        """Seconds to wait before the next restart."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** self.recent(restarts, now))


class Supervised(Protocol):
    """What `supervise` runs (LocalCluster, Launch)."""

    replicas: list[Proc]
    router: Proc | None
    policy: RestartPolicy

    def start(self) -> None: ...
    def ready_line(self) -> str: ...
    def stop(self) -> None: ...
    def lost(self) -> str:
        """Why the cluster cannot come back ("" while it can): the allocation ended, no node answers."""
        ...
    def changed(self) -> None:
        """A replica ended, was restarted or got ready (a launch records it for `pdcluster status`)."""
        ...
    def failed(self, message: str) -> None:
        """The run failed for good, for `message` (called before `stop`)."""
        ...


def _say(tool: str, text: str) -> None:
    print(f"{tool}: {text}", file=sys.stderr, flush=True)


def supervise(tool: str, cluster: Supervised) -> int:
    """Start `cluster`, print its ready line, keep it up; 0 after Ctrl-C / SIGTERM, 1 when it failed."""
    stop = threading.Event()
    starting = True

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if starting:  # break out of the start's waits at once; `stop()` below ends what it started
            raise Interrupted(f"stopped by signal {signal.Signals(signum).name} while starting")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failure = ""
    try:
        try:
            cluster.start()
        finally:
            starting = False
        sys.stdout.write(cluster.ready_line() + "\n")  # one write (print() splits it when unbuffered)
        sys.stdout.flush()
        failure = Watch(tool, cluster).run(stop)
    except Interrupted:
        pass  # said below
    except (RuntimeError, ValueError, OSError) as exc:  # a start that failed says why in its message
        failure = str(exc)
        _say(tool, failure)
    finally:
        if stop.is_set() and not failure:
            _say(tool, "stopping (signal)")
        if failure:
            cluster.failed(failure)
        cluster.stop()
    return 1 if failure else 0


class Watch:
    """The supervision loop over a started cluster."""

    def __init__(self, tool: str, cluster: Supervised) -> None:
        self.tool = tool
        self.cluster = cluster
        self.due: dict[str, float] = {}  # replica name -> monotonic time of its restart
        self.seen_ready: set[str] = set()

    def run(self, stop: threading.Event, period: float = 0.5) -> str:
        """Until `stop` (""), or the cluster fails for good (why)."""
        while not stop.wait(period):
            failure = self.step(time.monotonic())
            if failure:
                _say(self.tool, f"{failure}: stopping the router and every replica")
                return failure
        return ""

    def step(self, now: float) -> str:
        """One look at every process; returns why the cluster failed for good ("" while it serves)."""
        router = self.cluster.router
        if router is not None and router.returncode is not None:
            return router.exit_message(router.returncode)
        for proc in self.cluster.replicas:
            if proc.ready and proc.name not in self.seen_ready:
                self.seen_ready.add(proc.name)
                if proc.restarts:
                    _say(self.tool, f"{proc.where} is serving again ({len(proc.restarts)} restart(s))")
                self.cluster.changed()
            code = proc.returncode
            if code is None or proc.name in self.due:
                continue
            failure = self._ended(proc, code, now)
            if failure:
                return failure
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                proc = next(p for p in self.cluster.replicas if p.name == name)
                proc.respawn()
                self.cluster.changed()
        return ""

    def _ended(self, proc: Proc, code: int, now: float) -> str:
        """A replica's run ended: schedule its restart, or say why the cluster cannot come back."""
        proc.exits.append(code)
        self.seen_ready.discard(proc.name)
        _say(self.tool, proc.exit_message(code))
        self.cluster.changed()
        lost = self.cluster.lost()
        if lost:
            return lost
        policy = self.cluster.policy
        if not policy.allows(proc.restarts, now):
            return (f"{proc.where} ended after {policy.recent(proc.restarts, now)} restart(s) within "
                    f"{policy.window_s:g} s: restart budget ({policy.max_restarts}) spent")
        delay = policy.delay(proc.restarts, now)
        self.due[proc.name] = now + delay
        count = policy.recent(proc.restarts, now) + 1
        _say(self.tool, f"restarting {proc.where} in {delay:g} s (restart {count} of at most "
                        f"{policy.max_restarts} within {policy.window_s:g} s)")
        return ""
