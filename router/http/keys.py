"""API keys: the `--api-keys` file, and finding the key a request presents (in constant time).

One key per line, then optional `name=`, `rpm=`, `concurrent=`, `tpm=` fields; `#` starts a
comment; blank lines are skipped:

    # KEY                      [name=NAME] [rpm=N] [concurrent=N] [tpm=N]
    sk-alice-0123456789abcdef  name=alice rpm=60 concurrent=4 tpm=100000
    sk-batch-fedcba9876543210  name=batch concurrent=16
    sk-ops-5555                              # no limits; named `line-4`

A limit left out is unlimited. A malformed line stops the router at start with `FILE:LINE: why`;
the message never contains the key itself (keys are never logged).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

LIMIT_FIELDS = ("rpm", "concurrent", "tpm")
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None = unlimited."""

    rpm: int | None = None  # requests admitted per rolling minute
    concurrent: int | None = None  # requests in flight at once (a stream until it ends)
    tpm: int | None = None  # prompt + completion tokens per rolling minute


@dataclass(frozen=True)
class ApiKey:
    """One configured key: its name (metrics and logs use the name, never the key) and limits."""

    name: str
    limits: KeyLimits
    digest: bytes  # sha256 of the key; the key text itself is not kept

    def __repr__(self) -> str:  # never print a digest either: it is enough to test guesses offline
        return f"ApiKey(name={self.name!r}, limits={self.limits!r})"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyTable:
    """The configured keys; `find` compares a presented key with every one of them."""

    def __init__(self, keys: list[ApiKey]) -> None:
        if not keys:
            raise ValueError("a key table needs at least one key")
        self.keys = tuple(keys)

    def find(self, presented: str) -> ApiKey | None:
        """The key equal to `presented`, or None.

        Constant time in the presented text: both sides are hashed to 32 bytes and every key is
        compared with `hmac.compare_digest`, with no early exit, so timing tells neither which key
        nor how much of one matched.
        """
        probe = _digest(presented)
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(probe, key.digest):
                found = key
        return found


def _positive(value: str, field: str, where: str) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise KeyFileError(f"{where}: `{field}` must be a whole number >= 1, got {value!r}")
    return int(value)


def parse_line(text: str, where: str, default_name: str) -> ApiKey | None:
    """One line of the key file (None for blank and comment lines); `where` is `FILE:LINE`."""
    fields = text.split("#", 1)[0].split()
    if not fields:
        return None
    key, *options = fields
    if "=" in key:
        raise KeyFileError(f"{where}: the line must start with the key, before any name=/rpm=/... field")
    values: dict[str, str] = {}
    for option in options:
        field, sep, value = option.partition("=")
        if not sep:  # not echoed: it may well be a second key
            raise KeyFileError(
                f"{where}: one key per line, then only name=, rpm=, concurrent=, tpm= fields "
                "(a key cannot contain spaces or '#')"
            )
        if field not in ("name", *LIMIT_FIELDS):
            raise KeyFileError(f"{where}: unknown field `{field}=` (expected name=, rpm=, concurrent=, tpm=)")
        if field in values:
            raise KeyFileError(f"{where}: `{field}` given twice")
        values[field] = value
    name = values.get("name", default_name)
    if not _NAME.fullmatch(name):
        raise KeyFileError(f"{where}: name {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . @ -")
    limits = KeyLimits(**{f: _positive(values[f], f, where) for f in LIMIT_FIELDS if f in values})
    return ApiKey(name=name, limits=limits, digest=_digest(key))


def load_key_file(path: Path) -> KeyTable:
    """Read `--api-keys`; raises `KeyFileError` naming the file and line of the first problem."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read the API key file: {exc}") from exc
    keys: list[ApiKey] = []
    first_line: dict[bytes, int] = {}
    name_line: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        where = f"{path}:{number}"
        key = parse_line(text, where, default_name=f"line-{number}")
        if key is None:
            continue
        if key.digest in first_line:
            raise KeyFileError(f"{where}: the same key as line {first_line[key.digest]}")
        if key.name in name_line:
            raise KeyFileError(f"{where}: name {key.name!r} already used on line {name_line[key.name]}")
        first_line[key.digest] = number
        name_line[key.name] = number
        keys.append(key)
    if not keys:
        raise KeyFileError(f"{path}: no API key in the file (remove --api-keys to serve without keys)")
    return KeyTable(keys)
