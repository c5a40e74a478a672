"""The router package's import graph, read from its source (every import statement, those under
`TYPE_CHECKING` and inside functions included): no cycle, protobuf and grpc only at the edges
(`client.py`, `admin.py`, and `main.py`, which wires them up), never the replica's packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EDGES = {"router.client", "router.admin", "router.main"}
WIRE = ("grpc", "protos", "grpc_health", "grpc_reflection", "google.protobuf")
FORBIDDEN = ("replica", "transfer", "scripts", "tests")


def module_names() -> dict[str, Path]:
    """Every module of the router package, by dotted name."""
    out = {}
    for path in sorted((ROOT / "router").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(path: Path, name: str) -> set[str]:
    """Dotted names of everything the module imports: `from P import x` counts the module P.x when
    x is one (a package importing its own submodules is no cycle), else P."""
    modules = module_names()
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            subs = {f"{base}.{alias.name}" for alias in node.names} & set(modules)
            found.update(subs or {base})
            if len(subs) < len(node.names):
                found.add(base)
    return found


def graph() -> dict[str, set[str]]:
    """Module → the router modules it imports."""
    modules = module_names()
    return {name: {m for m in imported(path, name) if m in modules and m != name}
            for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_router() -> None:
    assert cycles(graph()) == []


def test_protobuf_and_grpc_only_at_the_edges_and_nothing_reaches_them() -> None:
    modules = module_names()
    wire = {name for name, path in modules.items()
            if any(m == w or m.startswith(w + ".") for m in imported(path, name) for w in WIRE)}
    assert wire <= EDGES, f"imports protobuf/grpc outside the edges: {sorted(wire - EDGES)}"
    edges = graph()
    for name in sorted(set(modules) - EDGES):
        reach: set[str] = set()
        todo = [name]
        while todo:
            for dep in edges[todo.pop()] - reach:
                reach.add(dep)
                todo.append(dep)
        assert not reach & EDGES, f"{name} reaches the edge modules {sorted(reach & EDGES)}"


def test_the_router_imports_nothing_of_the_replica_or_the_launchers() -> None:
    bad = {name: sorted(m for m in imported(path, name) if m.split(".")[0] in FORBIDDEN)
           for name, path in module_names().items()}
    assert {k: v for k, v in bad.items() if v} == {}
