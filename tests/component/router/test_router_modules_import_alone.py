"""Each router module imports on its own, whatever was imported before it (a fresh interpreter;
the router's modules are dropped before each one): an import cycle that only bites in some order
fails here. The modules other than the edges load neither grpc nor protobuf, and none the replica."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EDGES = ("router.client", "router.admin", "router.main")

_PROBE = """
import importlib, json, sys
names, edges = json.loads(sys.argv[1]), json.loads(sys.argv[2])
failed = {}
for name in [n for n in names if n not in edges] + edges:
    if name in edges and "wire" not in failed:
        failed["wire"] = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "protos"))
    for loaded in [m for m in sys.modules if m == "router" or m.startswith("router.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
failed["replica"] = sorted(m for m in sys.modules if m.split(".")[0] in ("replica", "transfer"))
print(json.dumps(failed))
"""


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_every_router_module_imports_alone_and_only_the_edges_load_grpc() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(_modules()), json.dumps(list(EDGES))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {"wire": [], "replica": []}
