"""Checks run before a subcommand's own code: the causes a new user meets first, each in one line.

```
 pdcluster replica --model DIR --port P   DIR a checkpoint? P free on --host?
 pdcluster router  --model DIR …          DIR has config.json + tokenizer.json? HTTP and admin ports free?
 pdcluster up      --model DIR …          both of the above, before any process starts
```
A problem found here ends the command with exit code 2 and `pdcluster NAME: CAUSE`, before the
replica or router code runs (and so before it can end in a traceback).

The checks are looked up by the subcommand's name, never by importing every config class: a
`pdcluster devices` on a bare node must not import the router's or the replica's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdcluster.discovery.checks import checkpoint_problem, port_problem

if TYPE_CHECKING:
    from pdcluster.cluster.local import UpConfig
    from replica.config import ReplicaConfig
    from router.config import RouterConfig


def _ports(host: str, ports: list[tuple[str, int]]) -> str:
    for flag, port in ports:
        problem = port_problem(host, port)
        if problem:
            return f"{problem} ({flag})"
    return ""


def _tp_problem(model: Path, tp: int) -> str:
    """Why `--tp` cannot cut this checkpoint's heads, MLP and vocabulary ("" when it can)."""
    from replica.model.config import ModelConfig, UnsupportedModel  # pure Python, like the check above
    from replica.model.layout import Shard, WeightLayout

    try:
        WeightLayout.for_config(ModelConfig.from_dir(model), "float32", Shard(0, tp))
    except UnsupportedModel as exc:
        return f"--tp {tp}: {exc}"
    return ""


def _replica(config: ReplicaConfig) -> str:
    weights = not config.inactive and not config.engine_tag  # a simulated engine reads no weights
    model = "" if config.model is None else checkpoint_problem(config.model, weights=weights)
    if not model and config.model is not None and config.tp > 1:
        model = _tp_problem(config.model, config.tp)
    return model or _ports(config.host, [("--port", config.port)])


def _router_or_up(config: RouterConfig | UpConfig, weights: bool) -> str:
    """The router reads the tokenizer and config.json only; `up`'s torch replicas the weights too."""
    ports = [("--http-port", config.http_port), ("--admin-port", config.admin_port)]
    return checkpoint_problem(config.model, weights=weights, tokenizer=True) or _ports(config.host, ports)


CHECKS: dict[str, Callable[[Any], str]] = {
    "replica": _replica,
    "router": lambda config: _router_or_up(config, weights=False),
    "up": lambda config: _router_or_up(config, weights=config.engine == "torch")
    or (_tp_problem(config.model, config.tp) if config.tp > 1 else ""),
}
"""The check of each subcommand that has one, by its name in `commands.COMMANDS`."""


def problem_of(name: str, config: object) -> str:
    """Why the subcommand `name` with `config` cannot start ("" when nothing is known to be wrong)."""
    check = CHECKS.get(name)
    return check(config) if check is not None else ""
