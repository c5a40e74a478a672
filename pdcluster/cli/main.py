"""The `pdcluster` command: subcommands from `commands.COMMANDS`, flags from their config dataclasses.

tyro builds the parser from each config dataclass: the field name is the flag (`num_blocks` →
`--num-blocks`), its type the parser (a bool gives `--x/--no-x`, a list takes several values, an
enum takes its values), its default the default and its ``metadata["help"]`` the help text. Three
more metadata keys are turned into tyro's annotations here, so the config classes import no CLI
library (`replica/config.py` and `router/config.py` stay pure Python):

- ``positional``: the field is a positional argument, shown as the field's name in upper case;
- ``choices``: the values allowed;
- ``flag``: the flag's name when it is not the field's (``"--json"`` for a field `json_out`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import tyro
from tyro.constructors import ConstructorRegistry, StructConstructorSpec, StructFieldSpec, StructTypeInfo

from pdcluster.cli.commands import COMMANDS, GROUPS
from pdcluster.cli.preflight import problem_of

DESCRIPTION = (
    "The `pdcluster` command: one subcommand per process or tool, each generated from a config dataclass."
)

REGISTRY = ConstructorRegistry()


def resolve(path: str) -> Any:
    """The object named by "module:name"."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@REGISTRY.struct_rule
def config_fields(info: StructTypeInfo) -> StructConstructorSpec | None:
    """The fields of a config dataclass (one whose fields carry help), their metadata as annotations."""
    cls = info.type
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if not any("help" in f.metadata for f in fields):
        return None  # not one of ours: tyro's own rules
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = [
        StructFieldSpec(name=f.name, type=_annotated(f, hints[f.name]), default=_default(f),
                        helptext=f.metadata.get("help"))
        for f in fields
    ]
    return StructConstructorSpec(instantiate=functools.partial(_checked, cls), fields=tuple(specs))


@dataclasses.dataclass(frozen=True)
class Refused:
    """What parsing gives when a config's own check (`__post_init__`) refused the values."""

    reason: str


def _checked(cls: type, **values: Any) -> object:
    """The config, or `Refused`: its message is printed as ours, not inside the parser's error box."""
    try:
        return cls(**values)
    except ValueError as exc:
        return Refused(str(exc))


def _annotated(f: dataclasses.Field[Any], tp: Any) -> Any:
    """The field's type with its `positional`, `choices` and `flag` metadata as tyro annotations."""
    meta = f.metadata
    if "choices" in meta:
        tp = Literal[tuple(meta["choices"])]
    marks: list[Any] = []
    if meta.get("positional"):
        marks += [tyro.conf.Positional, tyro.conf.arg(metavar=f.name.upper())]
    if "flag" in meta:
        marks.append(tyro.conf.arg(name=meta["flag"].removeprefix("--")))
    return Annotated[(tp, *marks)] if marks else tp


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return tyro.MISSING_NONPROP  # a required flag


def command_type() -> Any:
    """Every subcommand as one union of tyro subcommands; a group's (`bench`) is a union of its own."""
    top: list[Any] = []
    groups: dict[str, list[Any]] = {}
    for name, command in COMMANDS.items():
        group, _, sub = name.partition(" ")
        marker = tyro.conf.subcommand(sub or name, description=command.help)
        entry: Any = Annotated[resolve(command.config), marker]
        (groups.setdefault(group, []) if sub else top).append(entry)
    for group, entries in groups.items():
        union: Any = Union[tuple(entries)]  # noqa: UP007
        top.append(Annotated[union, tyro.conf.subcommand(group, description=GROUPS[group])])
    return Union[tuple(top)]  # noqa: UP007


def runner_of(config: object) -> Any:
    """The runner of the subcommand whose config this is."""
    for command in COMMANDS.values():
        if command.config == _path_of(type(config)):
            return resolve(command.runner)
    raise LookupError(f"no subcommand takes a {type(config).__name__}")


def _path_of(cls: type) -> str:
    """"module:name" of a config class, as `COMMANDS` names it: matched without importing the other
    subcommands' config modules (`pdcluster devices` must not import the router's)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def named_command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` starts with ("replica", "bench serving"), if any."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name
    return None


def parse(argv: Sequence[str] | None = None) -> object:
    """The filled-in config of the subcommand `argv` names, or `Refused` (SystemExit: --help, bad flags).

    When `argv` names a subcommand, only its config class is imported and parsed: a replica
    process does not import every other command's modules before it starts.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    name = named_command(args)
    if name is not None:
        command = COMMANDS[name]
        return tyro.cli(resolve(command.config), prog=f"pdcluster {name}", description=command.help,
                        args=args[len(name.split()):], registry=REGISTRY,
                        config=(tyro.conf.EnumChoicesFromValues,))
    return tyro.cli(command_type(), prog="pdcluster", description=DESCRIPTION, args=args, registry=REGISTRY,
                    config=(tyro.conf.EnumChoicesFromValues,))


DEBUG_FLAG = "--debug"
"""Anywhere on the command line: a failure shows its traceback instead of one line."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdcluster` console script: the subcommand's exit code (2: bad arguments).

    A failure the command knows about prints one line, `pdcluster NAME: CAUSE`, and exits non-zero;
    an unexpected one too (naming its type), with the traceback only under `--debug`.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        config = parse(args)
    except SystemExit as done:  # --help (0), or arguments the parser refused (2)
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    if isinstance(config, Refused):
        print(f"pdcluster: invalid arguments: {config.reason}", file=sys.stderr)
        return 2
    name = command_name(config)
    problem = problem_of(name, config)
    if problem:
        print(f"pdcluster {name}: {problem}", file=sys.stderr)
        return 2
    try:
        return int(runner_of(config)(config) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        print(f"pdcluster {name}: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


def _one_line(exc: BaseException) -> str:
    """What to print for a failure: our errors' messages say it all; others get their type named."""
    text = str(exc).strip()
    if isinstance(exc, (ValueError, RuntimeError)) and text:
        return text
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {text or '(no message)'} (run with --debug for the traceback)"


def command_name(config: object) -> str:
    """The subcommand whose config this is ("bench serving", "up", …)."""
    for name, command in COMMANDS.items():
        if command.config == _path_of(type(config)):
            return name
    return type(config).__name__
