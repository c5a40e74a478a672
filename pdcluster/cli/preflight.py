"""Checks run before a subcommand's own code: the causes a new user meets first, each in one line.

```
 pdcluster replica --model DIR --port P   DIR a checkpoint? P free on --host?
 pdcluster router  --model DIR …          DIR has config.json + tokenizer.json? HTTP and admin ports free?
 pdcluster up      --model DIR …          both of the above, before any process starts
```
A problem found here ends the command with exit code 2 and `pdcluster NAME: CAUSE`, before the
replica or router code runs (and so before it can end in a traceback).
"""

from __future__ import annotations

from pdcluster.cluster.local import UpConfig
from pdcluster.discovery.checks import checkpoint_problem, port_problem
from replica.config import ReplicaConfig
from router.config import RouterConfig


def _ports(host: str, ports: list[tuple[str, int]]) -> str:
    for flag, port in ports:
        problem = port_problem(host, port)
        if problem:
            return f"{problem} ({flag})"
    return ""


def problem_of(config: object) -> str:
    """Why `config`'s command cannot start ("" when nothing is known to be wrong)."""
    if isinstance(config, ReplicaConfig):
        weights = not config.inactive and not config.engine_tag  # a simulated engine reads no weights
        model = "" if config.model is None else checkpoint_problem(config.model, weights=weights)
        return model or _ports(config.host, [("--port", config.port)])
    if isinstance(config, RouterConfig | UpConfig):
        ports = [("--http-port", config.http_port), ("--admin-port", config.admin_port)]
        # the router reads the tokenizer and config.json only; simulated replicas need no weights
        weights = isinstance(config, UpConfig) and config.engine == "torch"
        return checkpoint_problem(config.model, weights=weights, tokenizer=True) or _ports(config.host, ports)
    return ""
