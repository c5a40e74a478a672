"""`pdcluster launch` as a test runs it: a cluster file written from a few facts, the launcher as a
subprocess (its ready line with a deadline, its stderr kept), and its end."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pdcluster(*args: str) -> list[str]:
    """`python -m pdcluster ARGS` with this interpreter."""
    return [sys.executable, "-m", "pdcluster", *args]


@dataclass(frozen=True)
class NodeLine:
    """One `[[nodes]]` table: name, address and its replicas by role (plus any extra `key = value` lines)."""

    name: str
    address: str
    roles: dict[str, int]
    extra: tuple[str, ...] = ()


def write_cluster_file(
    path: Path,
    model: Path,
    nodes: Sequence[NodeLine],
    via: str,
    router_host: str,
    launch: Sequence[str] = (),
    ssh_config: Path | None = None,
    router: Sequence[str] = (),
) -> Path:
    """A cluster file for `nodes`: CPU workers, small KV caches, one torch thread, logs beside the file;
    `launch` and `router`: more lines of those tables."""
    lines = [
        f'[model]\npath = "{model}"',
        f'[router]\nhost = "{router_host}"\nhttp_port = 0\nadmin_port = 0\n' + "\n".join(router),
        f'[launch]\nvia = "{via}"\nnum_blocks = 256\ntorch_threads = 1\nready_timeout_s = 180\n'
        f'log_dir = "{path.parent / "logs"}"\n' + "\n".join(launch),
    ]
    if ssh_config is not None:
        lines.append(f'[ssh]\nconfig = "{ssh_config}"\nconnect_timeout_s = 10')
    for node in nodes:
        roles = "\n".join(f"{role} = {count}" for role, count in node.roles.items())
        lines.append(
            f'[[nodes]]\nname = "{node.name}"\naddress = "{node.address}"\ndevices = "cpu"\n{roles}\n'
            + "\n".join(node.extra)
        )
    path.write_text("\n\n".join(lines) + "\n")
    return path


class Launched:
    """A running launcher: stdout's first line is its ready line; stderr is kept whole."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self._stdout: queue.Queue[str | None] = queue.Queue()  # None: stdout closed
        self._stderr: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        self._err_pump = threading.Thread(target=self._pump_err, daemon=True)
        self._err_pump.start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._stdout.put(line.rstrip("\n"))
        self._stdout.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        """Everything it printed on stderr so far."""
        return "\n".join(self._stderr)

    def ready(self, timeout: float) -> str:
        """Its ready line (AssertionError with its stderr when it ends or is late)."""
        try:
            line = self._stdout.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no ready line in {timeout} s:\n{self.stderr}") from None
        if line is None:
            self._err_pump.join(10)  # the rest of stderr
            raise AssertionError(f"ended with {self.proc.wait(10)} before its ready line:\n{self.stderr}")
        assert " ready: " in line, f"{line}\n{self.stderr}"
        return line

    def wait(self, timeout: float) -> int:
        """Its exit code, once all of its stderr is read (it is killed past `timeout`, and the test fails)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.stderr}") from None
        self._err_pump.join(10)  # all it wrote is read (a child still holding the pipe: 10 s at most)
        return code

    def kill(self) -> None:
        """SIGKILL it if it still runs (its children die with it: parent-death signal)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def ready_fields(line: str) -> dict[str, str]:
    """`key=value` words of a ready line, and `replicas` as its bracketed list."""
    fields = dict(
        part.split("=", 1) for part in line.split() if "=" in part and not part.startswith("replicas")
    )
    fields["replicas"] = line.split("replicas=[", 1)[1].split("]", 1)[0]
    return fields
