"""The import graph of the whole tree: acyclic, layered, the weight transport free of vLLM.

Which imports count: every import statement of a module, at module level, inside functions
and under ``TYPE_CHECKING`` alike. A function-level import is how a cycle hides: Python
tolerates it at import time, but the two modules still need each other and cannot be read,
tested or changed apart. An edge goes to the module a name is imported from, or to the
submodule when the name is one (``from . import api``). Python's import of a parent package
before its submodules is not an edge: it is how every package loads.

The layers, bottom up: ``vllm_ext.transport`` (the weight transport both ends share, no vLLM);
``patches``, ``titan_ext``, ``vllm_ext``, ``router_ext`` (the extensions of each upstream);
``rl_loop`` (the RL loop that drives them); ``benchmarks`` (measures all of it). Nothing
imports a layer above its own, and ``benchmarks`` does not reach into ``tests``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import parse_python

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("titan_ext", "vllm_ext", "router_ext", "rl_loop", "patches", "benchmarks")
TRANSPORT = "vllm_ext.transport"
BELOW_RL_LOOP = ("vllm_ext", "titan_ext", "router_ext", "patches")
SCANNED_FOR_PATH_EDITS = (*PACKAGES, "tests", "scripts")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` (module ``name``) imports anywhere in its source, relative imports
    resolved: for ``from base import x``, ``base.x`` when that is a module of ``modules``, else ``base``."""
    is_pkg = path.stem == "__init__"
    targets: set[str] = set()
    for node in ast.walk(parse_python(path.read_text(), str(path))):
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
    return targets - {name}


def tree_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def import_graph(root: Path, packages: tuple[str, ...]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the modules of ``packages`` it imports, module -> the other modules it imports)."""
    modules = tree_modules(root, packages)
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = imports_of(name, path, modules)
        inside[name] = {t for t in targets if t in modules}
        outside[name] = targets - inside[name]
    return inside, outside


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph(ROOT, PACKAGES)


def test_the_tree_import_graph_is_acyclic(graph):
    inside, _ = graph
    cycle = find_cycle(inside)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_import_reaches_up_to_rl_loop(graph):
    inside, _ = graph
    upward = sorted(f"{m} -> {t}" for m, ts in inside.items() for t in ts
                    if any(in_package(m, p) for p in BELOW_RL_LOOP) and in_package(t, "rl_loop"))
    assert upward == [], "imports from below rl_loop up into it:\n" + "\n".join(upward)


def test_the_transport_imports_nothing_of_vllm_nor_above_it(graph):
    inside, outside = graph
    transport = [m for m in inside if in_package(m, TRANSPORT)]
    assert transport, f"no modules found under {TRANSPORT}"
    for m in transport:
        project = reachable(inside, m)
        above = sorted(p for p in project if not in_package(p, TRANSPORT))
        assert above == [], f"{m} imports project modules outside {TRANSPORT}: {above}"
        vllm = sorted(t for p in project for t in outside.get(p, ()) if t == "vllm" or t.startswith("vllm."))
        assert vllm == [], f"{m} imports vLLM (directly or through the modules it imports): {vllm}"


def test_importing_the_transport_loads_no_vllm():
    """What the trainer side loads: every transport module, its parent packages' ``__init__`` included."""
    modules = sorted(m for m in tree_modules(ROOT, ("vllm_ext",)) if in_package(m, TRANSPORT))
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_benchmarks_import_nothing_from_tests(graph):
    _, outside = graph
    found = sorted(f"{m} -> {t}" for m, ts in outside.items() if in_package(m, "benchmarks")
                   for t in ts if in_package(t, "tests"))
    assert found == [], "benchmarks import tests:\n" + "\n".join(found)


MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "setdefault", "update", "__setitem__"}


def path_edits(source: str, filename: str = "<string>") -> list[int]:
    """The lines of ``source`` that change ``sys.path`` or ``sys.modules``, also inside string constants
    that are Python (code handed to ``python -c`` or to a worker): a line in such a string counts as
    the line where the string starts."""
    lines = []
    for node in ast.walk(parse_python(source, filename)):
        if (text := _string_text(node)) is not None:
            if "sys." in text:
                try:
                    if path_edits(textwrap.dedent(text)):
                        lines.append(node.lineno)
                except SyntaxError:
                    pass  # prose, not code
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value] if node.func.attr in MUTATORS else []  # sys.path.insert(...)
        elif isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        # sys.path = ..., sys.path += ..., sys.modules[x] = ..., del sys.modules[x]
        if any(_is_sys_attr(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
            lines.append(node.lineno)
    return sorted(lines)


def _string_text(node: ast.AST) -> str | None:
    """A string constant's text; an f-string's with each replacement field as a name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
    return None


def _is_sys_attr(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("path", "modules")
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def test_no_module_edits_sys_path_or_sys_modules():
    files = [p for pkg in SCANNED_FOR_PATH_EDITS for p in sorted((ROOT / pkg).rglob("*.py"))
             if p != Path(__file__).resolve()]  # this file: its self-test writes such edits on purpose
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in path_edits(p.read_text(), str(p))]
    assert found == [], "sys.path / sys.modules edited (import by package path instead):\n" + "\n".join(found)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checks_see_hidden_cycles_and_indirect_vllm(tmp_path):
    """The checks above could pass by seeing nothing: here each one finds what it must."""
    _write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import g\n",
        "pkg/b.py": "def g():\n    from . import a\n    return a\n",
        "pkg/c.py": "import pkg.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import d\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "def f():\n    from ..e import x\n",
        "pkg/e.py": "import vllm.config\n",
        "pkg/f.py": "import sys\nsys.path.insert(0, '.')\nsys.modules['x'] = sys\nsys.path += ['.']\nsys.modules.get('x')\n"
                    "CODE = 'import sys; sys.path.append(\"/x\")'\nDOC = 'see sys.path'\n"
                    "W = f'''\n    import sys\n    sys.path.insert(0, {DIR!r})\n'''\n",
    })
    inside, outside = import_graph(tmp_path, ("pkg",))
    assert inside["pkg.a"] == {"pkg.b"} and inside["pkg.b"] == {"pkg.a"}
    assert inside["pkg.c"] == {"pkg.a", "pkg.sub.d"}
    assert inside["pkg.sub.d"] == {"pkg.e"}
    assert find_cycle(inside) == ["pkg.a", "pkg.b", "pkg.a"]
    assert "vllm.config" in {t for m in reachable(inside, "pkg.c") for t in outside[m]}
    assert path_edits((tmp_path / "pkg/f.py").read_text()) == [2, 3, 4, 6, 8]
    (tmp_path / "pkg/b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))[0]) is None


def test_no_two_test_files_share_a_name():
    """``tests/unit`` and ``tests/integration`` are not packages, so pytest imports each test file
    by its bare name: two files of one name make collection fail (an error CI has hit)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.parent != ROOT / "tests":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
