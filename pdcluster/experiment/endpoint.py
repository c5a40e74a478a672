"""A cell's external OpenAI server (vLLM, SGLang, another pdcluster): reached at a URL, started first
when the experiment file gives its command.

```
 [[endpoints]] url = "http://127.0.0.1:{port}"            {port}: a free port, {host}: 127.0.0.1,
               launch = ["{python}", "-m", "…", "--model", "{model}", "--port", "{port}"]
               requires = ["/opt/vllm-venv/bin/python"]   missing → the cell is skipped, with the reason
```
Started servers are ready once `GET /v1/models` answers; they are stopped (SIGTERM, then SIGKILL) when
the cell ends and die with this process.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from pdcluster.cluster.processes import Proc, spawn, stop_procs
from pdcluster.cluster.replica_process import free_ports
from pdcluster.experiment.cluster import log_tail
from pdcluster.experiment.spec import EndpointSpec


def skip_reason(spec: EndpointSpec) -> str:
    """Why this endpoint cannot run here ("" when it can): a required path is missing."""
    missing = [p for p in spec.requires if not Path(p).exists()]
    if missing:
        return f"endpoint {spec.name!r} needs {', '.join(missing)}, which this machine lacks"
    return ""


class Endpoint:
    """The server of an endpoint cell."""

    def __init__(self, spec: EndpointSpec, model: Path, folder: Path) -> None:
        self.spec = spec
        self.model = model
        self.folder = folder
        self.proc: Proc | None = None
        self.port = free_ports(1)[0] if "{port}" in spec.url else 0
        self.http_url = self._fill(spec.url).rstrip("/")

    def _fill(self, text: str) -> str:
        return text.replace("{model}", str(self.model)).replace("{host}", "127.0.0.1").replace(
            "{port}", str(self.port))

    def start(self) -> None:
        """Start the server when the spec says how, then wait until it answers."""
        deadline = time.monotonic() + self.spec.ready_timeout
        if self.spec.launch:
            logs = self.folder / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            env = [f"{k}={self._fill(v)}" for k, v in self.spec.env.items()]
            argv = ["env", *env, *(self._fill(a) for a in self.spec.launch)]
            self.proc = spawn(self.spec.name, "endpoint", argv, logs / f"{self.spec.name}.log")
        while not self._answers():
            if self.proc is not None and self.proc.popen.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.popen.returncode}\n"
                                   f"{log_tail(self.proc.log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.http_url}/v1/models did not answer within "
                                   f"{self.spec.ready_timeout} s")
            time.sleep(1.0)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v1/models", timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def processes(self) -> list[Proc]:
        """The started server (for the resource sampler)."""
        return [self.proc] if self.proc else []

    def stop(self) -> None:
        """Stop the server this started (a server that was already running is left alone)."""
        if self.proc is not None:
            stop_procs([self.proc], timeout=30.0)
