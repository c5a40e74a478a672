"""Command-line flags (an experiment's `router_args` / `replica_args`) onto a config dataclass, in process.

The words are read as the CLI reads them: `--name VALUE` for a field `name`, `--flag` / `--no-flag`
for a boolean one, `--name V1 V2 …` for a list; values take the field's type (enums by value). An
unknown flag, or a value the config refuses, is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def with_flags(cls: type[C], base: dict[str, Any], words: Sequence[str]) -> C:
    """`cls(**base)` with the flags `words` applied on top."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = dict(base)
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise ValueError(f"a flag expected, got {word!r}")
        name = word[2:].replace("-", "_")
        if name.startswith("no_") and hints.get(name[3:]) is bool:
            values[name[3:]], i = False, i + 1
            continue
        if name not in names:
            raise ValueError(f"no flag {word}")
        kind = hints[name]
        if kind is bool:
            values[name], i = True, i + 1
            continue
        taken = _until_flag(words[i + 1:])
        if not taken:
            raise ValueError(f"{word} needs a value")
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            values[name] = [_convert(item, w, word) for w in taken]
        else:
            values[name] = _convert(kind, taken[0], word)
            taken = taken[:1]
        i += 1 + len(taken)
    return cls(**values)


def _until_flag(words: Sequence[str]) -> list[str]:
    out = []
    for word in words:
        if word.startswith("--"):
            break
        out.append(word)
    return out


def _convert(kind: Any, value: str, flag: str) -> Any:
    for option in typing.get_args(kind) or (kind,):
        if option is type(None):
            continue
        try:
            if option is Path:
                return Path(value)
            if isinstance(option, type) and issubclass(option, enum.Enum):
                return option(value)
            return option(value)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"{flag} {value!r}: not a {kind}")
