"""The `pdcluster` command: one subcommand per process or tool, each generated from a config dataclass.

Every subcommand is a pair (config dataclass, runner). The parser is built from the dataclass's
fields: the field name is the flag (`num_blocks` → `--num-blocks`), its type the parser, its
default the default, and its ``metadata["help"]`` the help text. A runner takes the filled-in
config and returns the process exit code. Modules are imported only when their subcommand runs,
so `pdcluster --help` stays fast and a missing optional extra breaks only its own subcommand.

Field metadata understood here:
- ``help``: the help text (required on every field);
- ``positional``: the field is a positional argument;
- ``choices``: the allowed values;
- ``nargs``: argparse's nargs for list fields (default ``"*"``);
- ``flag``: an explicit flag name instead of the one derived from the field name.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import importlib.util
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# subcommand -> (help, "module:ConfigClass", "module:runner"); a name with a space is "group sub".
COMMANDS: dict[str, tuple[str, str, str]] = {
    "replica": (
        "run one replica server process",
        "replica.config:ReplicaConfig",
        "replica.server.main:serve",
    ),
    "router": (
        "run the router (HTTP front end + admin gRPC)",
        "router.config:RouterConfig",
        "router.main:serve",
    ),
    "up": (
        "start a whole cluster on this machine",
        "pdcluster.cluster.local:UpConfig",
        "pdcluster.cluster.local:run",
    ),
    "launch": (
        "start replicas across nodes over ssh or Slurm srun, then the router",
        "pdcluster.cluster.launch:LaunchConfig",
        "pdcluster.cluster.launch:run",
    ),
    "demo": (
        "set up a tiny model and cluster, serve a few requests",
        "pdcluster.cli.demo:DemoConfig",
        "pdcluster.cli.demo:run",
    ),
    "make-tiny-model": (
        "write a random-weight Hugging Face checkpoint with a locally trained tokenizer",
        "pdcluster.tools.tiny_model:TinyModelConfig",
        "pdcluster.tools.tiny_model:run",
    ),
    "bench replica": (
        "prefill/decode tokens/s over gRPC, in-process and with transformers",
        "pdcluster.bench.replica:BenchReplicaConfig",
        "pdcluster.bench.replica:run",
    ),
    "bench transfer": (
        "transfer-layer GB/s against raw sockets and gloo ceilings",
        "pdcluster.bench.transfer:BenchTransferConfig",
        "pdcluster.bench.transfer:run",
    ),
    "bench migration": (
        "KV migration bytes/s against the fabric's p2p",
        "pdcluster.bench.migration:BenchMigrationConfig",
        "pdcluster.bench.migration:run",
    ),
    "bench load": (
        "checkpoint loading and weight multicast against raw reads and p2p",
        "pdcluster.bench.load:BenchLoadConfig",
        "pdcluster.bench.load:run",
    ),
    "bench serving": (
        "end-to-end serving benchmark (TTFT, TPOT, ITL, goodput)",
        "pdcluster.bench.serving.bench:BenchServingConfig",
        "pdcluster.bench.serving.bench:run",
    ),
}


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _available(path: str) -> bool:
    module = path.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _scalar_parser(tp: Any) -> Callable[[str], Any]:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda text: tp(text) if not text.isdigit() else tp(int(text))
    if tp is Path:
        return Path
    if tp in (int, float, str):
        return typing.cast(Callable[[str], Any], tp)
    raise TypeError(f"unsupported config field type {tp!r}")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argument per field of the config dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        meta = f.metadata
        tp = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"help": meta.get("help", "")}
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if meta.get("positional"):
            names = [f.name]
            kwargs["metavar"] = f.name.upper()
        else:
            names = [flag]
            kwargs["dest"] = f.name
            kwargs["default"] = default
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kwargs["required"] = True
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            kwargs["type"] = _scalar_parser(item)
            kwargs["nargs"] = meta.get("nargs", "*")
        else:
            kwargs["type"] = _scalar_parser(tp)
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            kwargs["choices"] = list(tp)
            kwargs["metavar"] = "{" + ",".join(str(m.value) for m in tp) + "}"
        if default is not None and not meta.get("positional") and tp is not bool:
            kwargs["help"] += f" (default: {_show(default)})"
        parser.add_argument(*names, **kwargs)


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)


def config_from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """Build the config dataclass from parsed arguments (its __post_init__ validates)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    for f in dataclasses.fields(cls):
        if isinstance(values.get(f.name), list) and not isinstance(f.default, list):
            tp = typing.get_origin(typing.get_type_hints(cls)[f.name])
            if tp is tuple:
                values[f.name] = tuple(values[f.name])
    return cls(**values)


def build_parser(load_configs: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    nested: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for name, (help_text, config_path, runner_path) in COMMANDS.items():
        if not (_available(config_path) and _available(runner_path)):
            continue
        group, _, sub = name.partition(" ")
        if sub:
            if group not in nested:
                holder = groups.add_parser(group, help=f"{group} tools")
                nested[group] = holder.add_subparsers(dest="subcommand", metavar="TOOL", required=True)
            sub_parser = nested[group].add_parser(sub, help=help_text, description=help_text)
        else:
            sub_parser = groups.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_entry=(config_path, runner_path))
        if load_configs:
            add_dataclass_arguments(sub_parser, _resolve(config_path))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdcluster` console script."""
    args = build_parser().parse_args(argv)
    config_path, runner_path = args._entry
    config_cls = _resolve(config_path)
    try:
        config = config_from_namespace(config_cls, args)
    except ValueError as exc:
        print(f"pdcluster: invalid arguments: {exc}", file=sys.stderr)
        return 2
    result = _resolve(runner_path)(config)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
