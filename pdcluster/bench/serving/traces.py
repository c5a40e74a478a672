"""Public LLM-serving traces read into rows of (arrival, input tokens, output tokens, prefix blocks) (pure).

- `mooncake`: JSONL `{"timestamp", "input_length", "output_length", "hash_ids"}`; timestamps in ms from
  the trace start; `hash_ids`: one id per 512-token prompt block;
- `azure`: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; wall time with 7 fractional digits;
- `burstgpt`: CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`; seconds from
  the trace start.

(Formats, sources and licenses: `docs/traces.md`; BurstGPT's as its upstream repository publishes
`BurstGPT_*.csv`.) Arrivals come back in seconds from the first row. Rows whose output is 0
tokens are dropped: BurstGPT logs failed requests that way, and a replayed request must generate at
least one token. A malformed row raises `TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("mooncake", "azure", "burstgpt")
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


class TraceError(ValueError):
    """A trace file that cannot be read: names the file and, for a bad row, its line."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: arrival in seconds from the trace's first row, its lengths, its blocks."""

    at: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def detect_format(path: Path) -> str:
    """`mooncake` for .jsonl; for .csv, `azure` or `burstgpt` by the header line."""
    if path.suffix == ".jsonl":
        return "mooncake"
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            header = next(csv.reader(handle), [])
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    names = tuple(h.strip() for h in header)
    if names[:3] == _AZURE_HEADER:
        return "azure"
    if names[:4] == _BURSTGPT_HEADER[:4]:
        return "burstgpt"
    raise TraceError(f"{path}:1: unknown trace header {header!r}; expected Azure {_AZURE_HEADER} "
                     f"or BurstGPT {_BURSTGPT_HEADER}")


def read_trace(path: Path, fmt: str = "") -> list[TraceRow]:
    """Every request of the trace at `path` (format `fmt`, or detected), in arrival order."""
    fmt = fmt or detect_format(path)
    readers = {"mooncake": _mooncake, "azure": _azure, "burstgpt": _burstgpt}
    if fmt not in readers:
        raise TraceError(f"{path}: unknown trace format {fmt!r}; choose from {', '.join(FORMATS)}")
    try:
        stamped = list(readers[fmt](path))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    if not stamped:
        raise TraceError(f"{path}: no requests")
    stamped.sort(key=lambda row: row.at)  # stable: rows of one timestamp keep their file order
    first = stamped[0].at
    return [TraceRow(row.at - first, row.input_len, row.output_len, row.hash_ids)
            for row in stamped if row.output_len > 0]


def _fail(path: Path, line: int, reason: str) -> TraceError:
    return TraceError(f"{path}:{line}: {reason}")


def _count(path: Path, line: int, value: Any, name: str) -> int:
    """A token count: a non-negative integer (CSV text or JSON number)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise _fail(path, line, f"{name} {value!r} is not an integer") from None
    if isinstance(value, float | bool) or number < 0:
        raise _fail(path, line, f"{name} {value!r} is not a non-negative integer")
    return number


def _mooncake(path: Path) -> Iterator[TraceRow]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(path, number, f"not JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise _fail(path, number, "not a JSON object")
            missing = [k for k in ("timestamp", "input_length", "output_length") if k not in item]
            if missing:
                raise _fail(path, number, f"missing {', '.join(missing)}")
            stamp = item["timestamp"]
            if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
                raise _fail(path, number, f"timestamp {stamp!r} is not a non-negative number of ms")
            hashes = item.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise _fail(path, number, "hash_ids is not a list of integers")
            yield TraceRow(stamp / 1000.0, _count(path, number, item["input_length"], "input_length"),
                           _count(path, number, item["output_length"], "output_length"), tuple(hashes))


def _csv_rows(path: Path, header: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of each data row, after checking the header's leading columns."""
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        first = next(reader, None)
        if first is None or tuple(c.strip() for c in first[: len(header)]) != header:
            raise _fail(path, 1, f"header {first!r} does not start with {list(header)}")
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue
            if len(cells) < len(header):
                raise _fail(path, reader.line_num, f"{len(cells)} columns, expected {len(header)}")
            yield reader.line_num, cells


def _azure(path: Path) -> Iterator[TraceRow]:
    for number, cells in _csv_rows(path, _AZURE_HEADER):
        stamp, _, frac = cells[0].strip().partition(".")
        try:  # 7 fractional digits (100 ns): datetime keeps 6
            when = datetime.datetime.fromisoformat(f"{stamp}.{frac[:6]:0<6}")
        except ValueError:
            raise _fail(path, number, f"TIMESTAMP {cells[0]!r} is not 'YYYY-MM-DD HH:MM:SS.fffffff'"
                        ) from None
        # the trace gives no time zone; only differences matter, so read it as UTC
        at = when.replace(tzinfo=datetime.UTC).timestamp()
        yield TraceRow(at, _count(path, number, cells[1], "ContextTokens"),
                       _count(path, number, cells[2], "GeneratedTokens"))


def _burstgpt(path: Path) -> Iterator[TraceRow]:
    for number, cells in _csv_rows(path, _BURSTGPT_HEADER[:4]):
        try:
            at = float(cells[0])
        except ValueError:
            raise _fail(path, number, f"Timestamp {cells[0]!r} is not a number of seconds") from None
        if not at >= 0:
            raise _fail(path, number, f"Timestamp {cells[0]!r} is negative")
        yield TraceRow(at, _count(path, number, cells[2], "Request tokens"),
                       _count(path, number, cells[3], "Response tokens"))
