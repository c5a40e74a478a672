"""The router's timeline (`--timeline FILE`): one JSON object per line, what the cluster did and why.

Each record has `t` (seconds on the monotonic clock since the router started), `wall` (Unix time, to
line runs up with other logs) and `kind`, plus the kind's fields:

| kind         | fields                                                                          |
|--------------|---------------------------------------------------------------------------------|
| `plan`       | `loads` (measured), `prefill`/`decode` (current, low, high, delta), `expire`, `actions` |
| `transition` | `replica`, `source`, `target`, `trigger`                                        |
| `transfer`   | `method`, `sources`, `targets`, `role`, `live`, `bytes`, `seconds`, `ok`, `error` |
| `relay`      | `new`, `old`, `batch`, `layer` (the layer the old replica resumed at)           |
| `request`    | `event` (arrival / first_token / finish) with the request's numbers              |

Writes are line-buffered and never raise into the router: a full disk loses timeline lines, not
requests (the first failure is logged).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("pdcluster.router")


class Timeline:
    """Appends records to a JSONL file (or nowhere, when no path is configured)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._file: IO[str] | None = None
        self._broken = False
        self.records = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1, encoding="utf-8")

    @property
    def enabled(self) -> bool:
        """Whether records go anywhere (callers skip building expensive ones otherwise)."""
        return self._file is not None and not self._broken

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record of `kind`."""
        file = self._file
        if file is None or self._broken:
            return
        record = {"t": round(self._clock() - self._start, 6), "wall": round(time.time(), 6), "kind": kind,
                  **fields}
        try:
            file.write(json.dumps(record, default=_plain) + "\n")
            self.records += 1
        except (OSError, ValueError) as exc:  # ValueError: the file was closed under it
            self._broken = True
            log.error("timeline: cannot write any more (%s); the router goes on without it", exc)

    def close(self) -> None:
        """Flush and close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _plain(value: object) -> object:
    """JSON for the values records carry: enums by value, dataclasses and sets as lists/dicts."""
    if hasattr(value, "value"):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return str(value)


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of a timeline file (for reports, plots and tests)."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
