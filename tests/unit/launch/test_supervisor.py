"""The supervision loop over fake processes: restarts with backoff inside a budget, giving up when the
budget is spent, the cluster is lost or the router ended; and the cause line read from a log."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.cluster.processes import Proc, last_error_line
from pdcluster.cluster.supervisor import RestartPolicy, Watch


@dataclass
class FakeProc:
    """What the loop reads of a `Proc`: runs until `end(code)`, `respawn()` starts it again."""

    name: str
    returncode: int | None = None
    ready: bool = True
    restarts: list[float] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    now: float = 0.0

    @property
    def where(self) -> str:
        return f"{self.name} on n1"

    def exit_message(self, code: int) -> str:
        return f"{self.where} exited with {code}"

    def respawn(self) -> None:
        self.restarts.append(self.now)
        self.returncode = None
        self.ready = False

    def end(self, code: int) -> None:
        self.returncode = code
        self.ready = False


POLICY = RestartPolicy(max_restarts=2, window_s=60, backoff_s=1)


@dataclass
class FakeCluster:
    replicas: list[FakeProc]
    router: FakeProc | None = None
    policy: RestartPolicy = field(default_factory=lambda: POLICY)
    why_lost: str = ""
    changes: int = 0

    def lost(self) -> str:
        return self.why_lost

    def changed(self) -> None:
        self.changes += 1


def watch(cluster: FakeCluster) -> Watch:
    return Watch("t", cluster)  # type: ignore[arg-type]


def test_a_dead_replica_is_restarted_after_a_doubling_backoff_then_the_budget_ends_it() -> None:
    replica = FakeProc("r1")
    cluster = FakeCluster([replica])
    w = watch(cluster)
    assert w.step(0.0) == ""
    replica.end(1)
    assert w.step(10.0) == "" and replica.restarts == []  # scheduled for 11.0
    assert w.step(10.9) == "" and replica.restarts == []
    replica.now = 11.0
    assert w.step(11.0) == "" and replica.restarts == [11.0]
    replica.end(1)
    assert w.step(12.0) == ""  # second restart after 2 s
    replica.now = 14.0
    assert w.step(14.0) == "" and replica.restarts == [11.0, 14.0]
    replica.end(7)
    failure = w.step(15.0)
    assert failure == "r1 on n1 ended after 2 restart(s) within 60 s: restart budget (2) spent"
    assert replica.exits == [1, 1, 7] and cluster.changes >= 5


def test_restarts_outside_the_window_do_not_count() -> None:
    policy = RestartPolicy(max_restarts=1, window_s=10, backoff_s=1)
    assert policy.allows([], 0) and not policy.allows([5.0], 6.0) and policy.allows([5.0], 15.1)
    assert policy.delay([], 0) == 1 and policy.delay([1.0, 2.0], 3.0) == 4
    assert RestartPolicy(backoff_s=1, backoff_max_s=5).delay([1.0] * 10, 2.0) == 5


def test_a_lost_cluster_or_a_dead_router_ends_at_once() -> None:
    replica = FakeProc("r1")
    cluster = FakeCluster([replica], why_lost="the Slurm allocation 7 ended (CANCELLED)")
    replica.end(0)
    assert watch(cluster).step(1.0) == "the Slurm allocation 7 ended (CANCELLED)"
    router = FakeProc("router")
    cluster = FakeCluster([FakeProc("r1")], router=router)
    w = watch(cluster)
    assert w.step(0.0) == ""
    router.end(1)
    assert w.step(1.0) == "router on n1 exited with 1"


def test_a_replica_back_at_work_is_noticed_once() -> None:
    replica = FakeProc("r1")
    cluster = FakeCluster([replica])
    w = watch(cluster)
    w.step(0.0)
    replica.end(1)
    w.step(1.0)
    replica.now = 2.0
    w.step(2.0)
    before = cluster.changes
    replica.ready = True
    w.step(3.0)
    w.step(3.5)
    assert cluster.changes == before + 1 and "r1" in w.seen_ready


def test_the_cause_line_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text(
        "2026-01-01 10:00:00,000 replica INFO loading\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "replica.model.config.CheckpointError: cannot read safetensors header of m\n"
    )
    assert last_error_line(log) == "replica.model.config.CheckpointError: cannot read safetensors header of m"
    log.write_text("2026-01-01 10:00:00,000 router ERROR cannot reach 10.0.0.2:5000\nbye\n")
    assert last_error_line(log) == "router ERROR cannot reach 10.0.0.2:5000"
    log.write_text("pdcluster replica: model folder m has no config.json (not a Hugging Face checkpoint)\r\n")
    assert last_error_line(log).endswith("has no config.json (not a Hugging Face checkpoint)")
    log.write_text("root@10.0.0.4: Permission denied (publickey).\n")
    assert last_error_line(log) == "root@10.0.0.4: Permission denied (publickey)."
    log.write_text("all is well\n")
    assert last_error_line(log) == "" and last_error_line(tmp_path / "missing.log") == ""


def test_fake_procs_cover_what_the_loop_reads() -> None:
    """The fakes above stand for `Proc`: the loop must not read anything else of it."""
    read = {"name", "where", "ready", "returncode", "restarts", "exits", "respawn", "exit_message"}
    assert read <= set(dir(Proc)) | set(Proc.__dataclass_fields__)
