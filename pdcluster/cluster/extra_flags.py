"""More flags of the processes a launch starts, from the cluster file: `[router] flags` and
`[launch] replica_flags`, tables of `name = value` (the flag's name without dashes).

```
 [router]
 flags = { heartbeat-timeout = 30, min-prefill = 1, timeline = "/tmp/t.jsonl" }
 [launch]
 replica_flags = { host-cache = true, disk-gbps = 16 }
        ─► router ... --heartbeat-timeout 30 --min-prefill 1 --timeline /tmp/t.jsonl
        ─► replica ... --host-cache --disk-gbps 16
```
A name must be a flag of that command (its config dataclass's field), and not one the launch sets
itself from the rest of the file (addresses, ports, ranks, roles, the model): checked with the
file, naming the line. A value is a string, a number, a boolean (true: `--name`, false:
`--no-name`) or a list of those (the flag repeated: `--name A B`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

Flags = tuple[tuple[str, tuple[str, ...]], ...]  # (name, its arguments: "--name", values...)

# Flags the launch gives from the rest of the file; set there, not here. TLS and the token come from
# [tls] and [cluster] token_file (a token given as a flag would show in the process list).
_SECURITY = frozenset({"tls_cert", "tls_key", "tls_ca", "tls_client_ca", "cluster_token",
                       "cluster_token_file"})
ROUTER_OWN = frozenset({"model", "replica", "role", "host", "http_port", "admin_port", "strategy", "scaling",
                        "admin_token", *_SECURITY})
REPLICA_OWN = frozenset({"model", "port", "host", "rank", "num_blocks", "torch_threads", "engine_cpus",
                         "fabric", "cluster", "inactive", "model_root", "role", "router", "tp", *_SECURITY})


def router_fields() -> set[str]:
    """The field names of `pdcluster router`'s config."""
    from router.config import RouterConfig

    return {f.name for f in dataclasses.fields(RouterConfig)}


def replica_fields() -> set[str]:
    """The field names of `pdcluster replica`'s config."""
    from replica.config import ReplicaConfig

    return {f.name for f in dataclasses.fields(ReplicaConfig)}


def _scalar(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float | str):
        return str(value)
    return None


def parse_flags(values: Mapping[str, object], fields: set[str], own: frozenset[str],
                error: Callable[[str, str], Exception]) -> Flags:
    """The flags of a `name = value` table; `error(name, message)` is raised for a bad entry."""
    flags: list[tuple[str, tuple[str, ...]]] = []
    for name, value in values.items():
        field = name.replace("-", "_")
        if field in own:
            raise error(name, f"{name!r} is set by the launch from the rest of the file")
        if field not in fields or name.startswith("-"):
            raise error(name, f"{name!r} is not a flag of this command (names without dashes in front, "
                              f"e.g. {sorted(fields - own)[0].replace('_', '-')!r})")
        if isinstance(value, bool):
            flags.append((name, (f"--{name}" if value else f"--no-{name}",)))
            continue
        items = value if isinstance(value, list) else [value]
        texts = [_scalar(item) for item in items]
        if not texts or any(t is None for t in texts):
            raise error(name, f"{name!r} takes a string, a number, a boolean or a list of strings and "
                              f"numbers, not {value!r}")
        flags.append((name, (f"--{name}", *(t for t in texts if t is not None))))
    return tuple(flags)


def flag_args(flags: Flags) -> list[str]:
    """The command-line arguments of `flags`."""
    return [arg for _, args in flags for arg in args]


def check_router_flag_names(flags: list[str]) -> None:
    """`pdcluster up --router-flag NAME=VALUE`'s names checked as the cluster file's `[router] flags`:
    a flag of `pdcluster router` that the launch does not set itself (ValueError naming it)."""
    fields = router_fields()

    def error(name: str, message: str) -> Exception:
        return ValueError(f"--router-flag {name}: {message}")

    for flag in flags:
        name, _, value = flag.partition("=")
        parse_flags({name: value}, fields, ROUTER_OWN, error)
