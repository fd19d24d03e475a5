"""vllm_ext.weights: its modules depend on each other one way (the import graph is acyclic).

Which imports count: every import statement in a module, at module level and inside
functions alike (TYPE_CHECKING blocks too). A function-level import is how a cycle hides:
Python tolerates it at import time, but the two modules still need each other and cannot be
read, tested or changed apart; that is what this test rules out. An edge is an import of
another module of the package (``from . import api`` names the submodule ``api``; a name
imported from a module is an edge to that module). Python's own import of a parent package
before its submodules is not an edge: it is how every package loads, and the package's
``__init__`` imports nothing at module level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_ext.weights"


def import_graph(pkg_dir: Path, package: str) -> dict[str, set[str]]:
    """Module -> the other modules of the (flat) package it imports anywhere in its source."""
    modules = {package if p.stem == "__init__" else f"{package}.{p.stem}": p for p in pkg_dir.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        is_pkg = path.stem == "__init__"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".")
                    anchor = parts[:len(parts) - node.level + is_pkg]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_weights_package_import_graph_is_acyclic():
    graph = import_graph(ROOT / "vllm_ext" / "weights", PACKAGE)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    w = {m.removeprefix(PACKAGE + "."): {t.removeprefix(PACKAGE + ".") for t in ts} for m, ts in graph.items()}
    # the layout: one leaf of shared primitives, one module per transport, orchestration on top
    assert w["format"] == set() and w["channel"] == {"format"}
    assert w["wire"] == {"format"} and w["shm"] == {"format"}
    assert w["te"] == {"format", "shm"}  # the Mooncake Transfer Engine lane: slots, hashes as the ring's
    assert w["stream"] == {"format", "shm", "te", "channel"}
    assert w["plan"] == set()  # the resharding plan: shapes and layouts only
    assert w["sharded"] == {"format", "plan", "shm", "stream"}
    assert w["served"] == set()  # the served policy version: told to subscribers, knows no transport
    assert w["peak_rss"] == set()  # the worker's peak memory over an update, read from /proc
    assert w["reload"] == {"format", "plan"}  # applying an update: experts stacked, names from the wire layout
    assert w["engine"] == {"format", "wire", "stream", "plan", "sharded", "served", "peak_rss", "reload"}
    assert w["swap"] == set()  # the API server's swap route: vLLM's engine client, no transport
    assert w["api"] == {"swap"}
    assert w["client"] == {"wire", "stream", "shm", "swap"}  # function-level imports: seen; swap: its route
    assert w[PACKAGE] == {"api"}  # `from . import api` inside register()


def test_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(pkg, "pkg")) is None


def test_filesystem_transport_imports_without_the_streaming_modules():
    """``import vllm_ext.weights.wire`` (what the trainer does to publish a version) loads the
    shared primitives and nothing of the streaming transport."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, vllm_ext.weights.wire; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('vllm_ext.weights'))))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == [PACKAGE, f"{PACKAGE}.format", f"{PACKAGE}.wire"]
