"""The `torchtitan` launcher: extension discovery by entry point, clear selection errors."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

TORCHTITAN = str(Path(sys.executable).parent / "torchtitan")


def _run(*args, env=None):
    return subprocess.run([TORCHTITAN, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_lists_titan_ext_models():
    out = _run("list", "--extension", "titan_ext")
    assert out.returncode == 0, out.stderr
    assert "kimi_k2: flavors full, tiny" in out.stdout and "glm5: flavors full, tiny" in out.stdout


def test_unknown_extension_lists_installed_ones():
    out = _run("train", "--extension", "nope", "--model", "kimi_k2")
    assert out.returncode != 0
    assert "unknown extension 'nope'" in out.stderr and "titan_ext" in out.stderr


def test_unknown_model_and_flavor_list_what_exists():
    out = _run("train", "--extension", "titan_ext", "--model", "llama9")
    assert out.returncode != 0 and "unknown model 'llama9'" in out.stderr and "glm5, kimi_k2" in out.stderr
    out = _run("train", "--extension", "titan_ext", "--model", "glm5", "--flavor", "huge")
    assert out.returncode != 0 and "unknown flavor 'huge'" in out.stderr and "full, tiny" in out.stderr


def test_third_party_extension_is_discovered_through_its_entry_point(tmp_path):
    """An extension written like titan_ext, installed only as a dist-info on sys.path, composes with it."""
    pkg = tmp_path / "acme_ext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from titan_ext.hookspecs import ModelEntry, hookimpl

        @hookimpl
        def torchtitan_register_models():
            return {"acme": ModelEntry(flavors=("small",), trainer_config=lambda flavor: None, description="acme")}
    """))
    dist = tmp_path / "acme_ext-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-ext\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[torchtitan.extensions]\nacme_ext = acme_ext\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = _run("list", "--extension", "titan_ext", "--extension", "acme_ext", env=env)
    assert out.returncode == 0, out.stderr
    assert "acme: flavors small" in out.stdout and "kimi_k2" in out.stdout


def test_help_of_every_command_exits_0():
    for args in (("--help",), ("-h",), ("list", "--help")):
        out = _run(*args)
        assert out.returncode == 0, (args, out.stderr[-2000:])
        assert "torchtitan list [--extension NAME ...]" in out.stdout, args


def _help_sections(out: subprocess.CompletedProcess) -> tuple[str, str]:
    """(the launcher's part, TorchTitan's part) of `torchtitan train ... --help`."""
    assert out.returncode == 0, out.stderr[-3000:]
    ours, marker, theirs = out.stdout.partition("TorchTitan's own flags follow.")
    assert marker, out.stdout[:3000]
    return ours, theirs


def test_train_help_lists_models_flavors_and_titan_ext_flags_then_torchtitans_own():
    ours, theirs = _help_sections(_run("train", "--extension", "titan_ext", "--help"))
    for flag in ("--extension NAME", "--model MODEL", "--flavor FLAVOR", "--titan_ext.dispatcher", "--titan_ext.fp8"):
        assert flag in ours and flag not in theirs, flag
    for model in ("kimi_k2", "glm5", "qwen3_moe"):
        assert re.search(rf"^  {model}: flavors .*\btiny\b", ours, re.M), model
    for flag in ("--training.steps", "--parallelism.expert-parallel-degree", "activation-checkpoint:full",
                 "activation-checkpoint:memory-budget"):
        assert flag in theirs, flag


def test_train_help_with_a_model_shows_its_defaults():
    _, theirs = _help_sections(_run("train", "--extension", "titan_ext", "--model", "glm5", "--flavor", "tiny", "-h"))
    assert re.search(r"--training\.seq-len INT\W+Sequence length \(default: 64\)", theirs), theirs[:3000]
