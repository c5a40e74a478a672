"""`[[models]]` of the cluster file: more models beside `[model]`, mirrored to the router's `--models`.

```toml
[[models]]
name = "beta"               # what clients put in `model`
path = "/shared/models/beta" # beside [model].path (in the replicas' model root: LoadParams finds it by name)
min_prefill = 0             # planner bounds of its own (optional; the router's flags otherwise)
min_decode = 0
max_prefill = 2
max_decode = 2
keep_alive_s = 30
```
Each entry becomes `--models NAME=DIR[,min-prefill=N,...]` (`router/models.py` parses it back), and
every replica gets `--weight-buffer-models` naming all the folders (room for the largest). Every
refusal names the entry's line: unknown keys, a missing name or path, a name used twice (or the
`[model]`'s own), a folder outside the model root, a bound that is not a number >= 0 or a minimum
above its maximum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL_KEYS = {"name", "path", "min_prefill", "min_decode", "max_prefill", "max_decode", "keep_alive_s"}
# table key → the router's `--models` option
_BOUNDS = {"min_prefill": "min-prefill", "min_decode": "min-decode", "max_prefill": "max-prefill",
           "max_decode": "max-decode", "keep_alive_s": "keep-alive"}

Fail = Callable[[tuple[str, ...], str], ValueError]  # (key in the entry, message) → an error naming its line
FailAt = Callable[[int, tuple[str, ...], str], ValueError]  # the same for entry `index`


@dataclass(frozen=True)
class ModelEntry:
    """One `[[models]]` table."""

    name: str
    path: Path
    bounds: tuple[tuple[str, float], ...] = ()  # (router option, value) in the table's order

    def router_arg(self) -> str:
        """Its `--models` value."""
        options = "".join(f",{key}={value:g}" for key, value in self.bounds)
        return f"{self.name}={self.path}{options}"


def parse_entry(values: dict[str, object], under: Callable[[str], Path], fail: Fail) -> ModelEntry:
    """One entry (its keys already checked against `MODEL_KEYS`); `under` makes a path absolute."""
    name, path = values.get("name"), values.get("path")
    if not isinstance(name, str) or not name:
        raise fail(("name",) if "name" in values else (), "needs name = what clients put in `model`")
    if any(c in name for c in ",= ") or name != name.strip():
        raise fail(("name",), f"name {name!r} may not hold commas, '=' or spaces")
    if not isinstance(path, str) or not path:
        raise fail(("path",) if "path" in values else (), "needs path = the checkpoint folder")
    if "," in path:
        raise fail(("path",), f"path {path!r} may not hold a comma (the router's --models splits on it)")
    return ModelEntry(name, under(path), tuple(_bound(key, values[key], fail) for key in _BOUNDS
                                               if key in values))


def _bound(key: str, value: object, fail: Fail) -> tuple[str, float]:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise fail((key,), f"{key} must be a number >= 0, not {value!r}")
    if key != "keep_alive_s" and not float(value).is_integer():
        raise fail((key,), f"{key} must be a whole number of replicas, not {value!r}")
    return _BOUNDS[key], float(value)


def check_entries(entries: list[ModelEntry], first: str, root: Path, fail: FailAt) -> None:
    """Across entries: unique names (none the `[model]`'s name `first`), folders directly under the
    model `root`, each minimum at most its maximum. `fail(index, key, message)`."""
    seen = {first: -1}
    for i, entry in enumerate(entries):
        if entry.name in seen:
            other = "the [model]'s folder name" if seen[entry.name] < 0 else f"models[{seen[entry.name]}]"
            raise fail(i, ("name",), f"model name {entry.name!r} is already {other}")
        seen[entry.name] = i
        if entry.path.parent != root:
            raise fail(i, ("path",), f"{entry.path} must sit directly in the replicas' model root {root} "
                                     "(LoadParams finds a model by its folder's name there)")
        bounds = dict(entry.bounds)
        for kind in ("prefill", "decode"):
            low, high = bounds.get(f"min-{kind}"), bounds.get(f"max-{kind}")
            if low is not None and high is not None and low > high:
                raise fail(i, (f"min_{kind}",), f"min_{kind} {low:g} is above max_{kind} {high:g}")
