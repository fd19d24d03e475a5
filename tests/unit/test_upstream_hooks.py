"""Every change to an upstream attribute is a registered `patches.Patch`, and none installs quietly.

* The code of the whole tree assigns to no attribute of vllm, torch, torchtitan, transformers or
  safetensors (a module, a class, through any alias, by `setattr` too) outside the modules
  `patches.PATCH_MODULES` registers; tests/ change upstream through pytest's monkeypatch only.
* Each registered patch's probe passes and its version range holds the installed version: an
  upstream upgrade that moves a target fails here before it fails a run.
* A probe that fails stops the process (required patch) or is a WARNING, a count and a
  response field (optional); importing titan_ext or vllm_ext changes nothing upstream.
"""

from __future__ import annotations

import ast
import importlib
import logging
import subprocess
import sys
import textwrap

import pytest

import patches
from tests.conftest import parse_python
from tests.unit.test_import_graph import ROOT

UPSTREAM = ("vllm", "torch", "torchtitan", "transformers", "safetensors")
WALKED = ("titan_ext", "vllm_ext", "router_ext", "rl_loop", "patches", "benchmarks", "tests", "scripts")


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain (`a.b.c`) starts from, None for anything else (a call, a subscript)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_upstream_module(name: str) -> bool:
    return name.split(".")[0] in UPSTREAM


def upstream_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of each assignment to an attribute of an upstream module or class in `source`.

    A name is upstream when it is bound by an import from an upstream package (at any level,
    inside functions too), by `importlib.import_module` of one, or by assigning or iterating
    over upstream names (`cls = mod.Scheduler`, `for mod in (chat_mod, cmpl_mod)`). Names are
    not told apart by scope: a local that shadows an upstream name counts as upstream."""
    tree = parse_python(source)
    strings = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
               for t in n.targets if isinstance(t, ast.Name)}
    upstream: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_upstream_module(a.name):
                    upstream.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _is_upstream_module(node.module):
            upstream |= {a.asname or a.name for a in node.names}

    def is_upstream(expr: ast.AST) -> bool:
        if isinstance(expr, (ast.Tuple, ast.List)):
            return bool(expr.elts) and all(is_upstream(e) for e in expr.elts)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "import_module" \
                and expr.args:
            arg = expr.args[0]
            name = arg.value if isinstance(arg, ast.Constant) else strings.get(getattr(arg, "id", None))
            return isinstance(name, str) and _is_upstream_module(name)
        return _root(expr) in upstream

    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, (ast.Tuple, ast.List, ast.Name)):
                pairs = [(node.target, node.iter)]
            for target, value in pairs:
                if isinstance(target, ast.Name) and target.id not in upstream and is_upstream(value):
                    upstream.add(target.id)
                    changed = True

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and is_upstream(node.args[0]):
            found.append((node.lineno, ast.unparse(node)))
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and _root(el) in upstream:
                    found.append((node.lineno, ast.unparse(el)))
    return sorted(found)


PLANTED = {
    "a dotted module": "import torch\ntorch._dynamo.config.recompile_limit = 64\n",
    "a module alias": "import torch.distributed as dist\ndist.destroy_process_group = print\n",
    "a class imported by name": "from vllm.v1.core.sched.scheduler import Scheduler\nScheduler.__init__ = print\n",
    "a function-level import": "def f():\n    from torchtitan import train as tt\n    tt.ConfigManager = object\n",
    "setattr": "from vllm.v1.engine.async_llm import AsyncLLM\nsetattr(AsyncLLM, 'pause_generation', print)\n",
    "a name bound to an upstream class": "from vllm.entrypoints.openai.completion import serving as m\n"
                                         "Cmpl = m.OpenAIServingCompletion\nCmpl.x = 1\n",
    "a loop over upstream modules": "from transformers import a, b\nfor mod in (a, b):\n    mod.f = print\n",
    "importlib by a constant": "import importlib\n_MOD = 'safetensors.torch'\nm = importlib.import_module(_MOD)\n"
                               "m.save_file = print\n",
    "an augmented assignment": "import torch\ntorch.x += 1\n",
}
CLEAN = {
    "an instance of an upstream class": "def f(out):\n    out.routed_experts = None\n",
    "a call": "import torch\ntorch.manual_seed(0)\nx = torch.zeros(3)\nx.grad = None\n",
    "our own module": "import vllm_ext.api as api\napi.x = 1\n",
    "monkeypatch": "import torch\ndef test(monkeypatch):\n    monkeypatch.setattr(torch, 'x', 1)\n",
    "a config patch context": "import torch\n@torch._dynamo.config.patch(recompile_limit=64)\ndef main(): pass\n",
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_walker_finds_a_planted_write(case):
    assert len(upstream_writes(PLANTED[case])) == 1, case


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_walker_leaves_other_writes_alone(case):
    assert upstream_writes(CLEAN[case]) == []


def test_no_upstream_attribute_is_written_outside_a_registered_patch_module():
    registered = {ROOT / (m.replace(".", "/") + ".py") for m in patches.PATCH_MODULES}
    registered |= {p.with_suffix("") / "__init__.py" for p in registered}
    walked = [p for pkg in WALKED for p in sorted((ROOT / pkg).rglob("*.py")) if p not in registered]
    assert len(walked) > 100  # the tree, not an empty glob
    writes = {str(p.relative_to(ROOT)): w for p in walked if (w := upstream_writes(p.read_text()))}
    assert writes == {}, ("assignments to upstream attributes outside a registered patch module: make each a "
                          f"patches.Patch in a module of patches.PATCH_MODULES: {writes}")


def test_the_registered_modules_hold_the_writes_they_are_registered_for():
    """The exemption is earned: every registered module of the tree defines patches."""
    for m in patches.PATCH_MODULES:
        assert importlib.import_module(m).PATCHES, m


def test_every_patch_probes_clean_on_the_installed_upstream():
    problems = {p.name: p.probe() for p in patches.all_patches()}
    assert {n: v for n, v in problems.items() if v is not None} == {}


def test_every_patch_was_written_for_the_installed_version():
    outside = {p.name: (p.versions, patches.installed_version(p.versions)) for p in patches.all_patches()
               if not patches.in_range(p.versions)}
    assert outside == {}, "upstream moved: re-check these patches against it, then widen their ranges"


def test_one_patch_per_upstream_attribute_and_name():
    every = patches.all_patches()
    assert len({p.name for p in every}) == len(every)
    assert len({p.target for p in every}) == len(every), "two patches replace one attribute: make one wrapper"
    for p in every:
        assert p.upstream and p.symptom and p.versions.split("<")[0].split(">")[0].split("=")[0] in UPSTREAM, p.name


def _broken(required: bool) -> patches.Patch:
    return patches.wrapper_patch(
        "moerl_test_broken", "torch.distributed:no_such_function", lambda orig: orig, versions="torch>=2.11,<2.14",
        upstream="a test", symptom="nothing: a test", required=required)


@pytest.fixture
def fresh_skips(monkeypatch):
    monkeypatch.setattr(patches, "_skipped", {})
    monkeypatch.setattr(patches, "_listeners", [])


def test_a_required_patch_that_no_longer_fits_stops_activation(fresh_skips):
    with pytest.raises(patches.PatchError) as e:
        patches.activate([_broken(required=True)])
    msg = str(e.value)
    assert "moerl_test_broken" in msg and "torch.distributed:no_such_function" in msg
    assert f"found torch {patches.installed_version('torch')}" in msg and "Install a version" in msg


def test_an_optional_patch_that_no_longer_fits_is_warned_counted_and_named(fresh_skips, caplog):
    from prometheus_client import CollectorRegistry

    from vllm_ext import metrics, serving

    registry = CollectorRegistry()
    counter = metrics.PatchesSkippedCounter(registry=registry)
    patches.on_skip(counter.inc)
    with caplog.at_level(logging.WARNING, logger="moerl.patches"):
        assert patches.activate([_broken(required=False)]) == []
    assert any("moerl_test_broken" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert list(patches.skipped()) == ["moerl_test_broken"]
    for name in metrics.PATCHES_SKIPPED:
        assert registry.get_sample_value(name + "_total", {"patch": "moerl_test_broken"}) == 1
    resp = type("Response", (), {})()
    serving._note_skipped(resp)  # noqa: SLF001 - what the serving wrappers do to every response
    assert getattr(resp, serving.SKIPPED_FIELD) == ["moerl_test_broken"]


def test_a_setting_torch_lacks_is_skipped_and_said(fresh_skips, monkeypatch, caplog):
    """As on the H200 machines' torch 2.11: the functorch setting titan_ext asks for is absent."""
    import torch._functorch.config as functorch_config

    from titan_ext.train_config import SCRIPT_OBJECTS_ZERO_SIZE

    monkeypatch.delattr(functorch_config, "unsafe_treat_script_objects_as_zero_size")
    with caplog.at_level(logging.WARNING, logger="moerl.patches"):
        assert patches.activate([SCRIPT_OBJECTS_ZERO_SIZE]) == []
    assert "no such setting" in patches.skipped()[SCRIPT_OBJECTS_ZERO_SIZE.name]
    assert any(SCRIPT_OBJECTS_ZERO_SIZE.name in r.getMessage() for r in caplog.records)
    assert not hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size")


def test_a_setting_torch_has_is_applied(fresh_skips, monkeypatch):
    import torch._functorch.config as functorch_config

    from titan_ext.train_config import SCRIPT_OBJECTS_ZERO_SIZE

    monkeypatch.setattr(functorch_config, "unsafe_treat_script_objects_as_zero_size", False)
    assert patches.activate([SCRIPT_OBJECTS_ZERO_SIZE]) == [SCRIPT_OBJECTS_ZERO_SIZE.name]
    assert functorch_config.unsafe_treat_script_objects_as_zero_size is True
    assert patches.activate([SCRIPT_OBJECTS_ZERO_SIZE]) == [] and patches.skipped() == {}


def test_importing_the_extensions_changes_nothing_upstream():
    """torch 2.13 lacks `torch.distributed.set_timeout` (a patch adds it): only activation adds it."""
    probe = textwrap.dedent("""
        import torch.distributed as dist
        import titan_ext, titan_ext.cli, titan_ext.train_config, vllm_ext, vllm_ext.hooks, vllm_ext.serving
        from vllm.v1.core.sched.scheduler import Scheduler
        print(hasattr(dist, "set_timeout"), hasattr(Scheduler.__init__, "_moerl_patch"))
        titan_ext.activate()
        print(hasattr(dist, "set_timeout"))
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True"]
