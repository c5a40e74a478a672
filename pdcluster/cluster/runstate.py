"""The record of a launched cluster, `LOG_DIR/run.json`: what `pdcluster status` and `down` read.

`pdcluster launch` writes it when it starts, on every change (a replica ready, ended, restarted)
and when it stops; writes are atomic (a temp file renamed over the old one). It names the
launcher's process (pid + start time, so a reused pid is not taken for it), the router's
addresses and every replica's rank, role, node, address, device and state.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"


class RunPhase(enum.Enum):
    """Where the launch is."""

    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class ReplicaRecord:
    """One replica as the launcher last saw it."""

    rank: int
    role: str
    node: str
    address: str
    device: str
    nic: str
    log: str
    state: str = "starting"  # starting | serving | ended (exit N) | restarting
    restarts: int = 0


@dataclass(frozen=True)
class RunRecord:
    """A launch, as `run.json` holds it."""

    run_id: str
    cluster_file: str
    via: str
    launcher_pid: int
    launcher_start: int  # /proc/PID/stat start time (clock ticks since boot)
    launcher_host: str
    node_dir: str
    slurm_job: str = ""
    phase: str = RunPhase.STARTING.value
    http: str = ""
    admin: str = ""
    admin_token_set: bool = False
    replicas: tuple[ReplicaRecord, ...] = ()
    nodes: tuple[str, ...] = ()
    logs: str = ""
    message: str = ""  # why it failed or stopped
    fabric: str = ""  # the launch's --fabric (auto: each replica picked; which one is not reported back)
    store: str = ""  # the rendezvous store the launch serves ("" for tcp and cuda-ipc)

    def with_(self, **changes: Any) -> RunRecord:
        """A copy with `changes`."""
        return replace(self, **changes)

    def to_json(self) -> str:
        """The file's text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        """Parse the file's text (ValueError when it is not a run record)."""
        try:
            data = json.loads(text)
            data["replicas"] = tuple(ReplicaRecord(**r) for r in data.get("replicas", ()))
            data["nodes"] = tuple(data.get("nodes", ()))
            return cls(**data)
        except (TypeError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a pdcluster run record: {exc}") from exc


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def this_launcher() -> dict[str, Any]:
    """The launcher fields of a new record: this process."""
    pid = os.getpid()
    return {"launcher_pid": pid, "launcher_start": process_start(pid) or 0,
            "launcher_host": socket.gethostname()}


def launcher_alive(record: RunRecord) -> bool:
    """Whether the launcher of `record` still runs (on this machine: same host name, pid, start time)."""
    return (record.launcher_host == socket.gethostname()
            and process_start(record.launcher_pid) == record.launcher_start)


@dataclass
class RunFile:
    """`LOG_DIR/run.json`."""

    log_dir: Path
    record: RunRecord | None = field(default=None)

    @property
    def path(self) -> Path:
        """The file."""
        return self.log_dir / RUN_FILE

    def read(self) -> RunRecord | None:
        """The record, None when there is no file."""
        try:
            return RunRecord.from_json(self.path.read_text())
        except FileNotFoundError:
            return None

    def write(self, record: RunRecord) -> None:
        """Replace the record atomically."""
        self.record = record
        self.log_dir.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(record.to_json())
        temp.replace(self.path)
