"""Every `moerl` command answers --help: exit 0, and the text lists each of its options with what it does."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from rl_loop.cli import DELEGATED, build_parser
from tests.conftest import ROOT, VENV_BIN


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _help(*args: str) -> str:
    proc = subprocess.run([str(VENV_BIN / "moerl"), *args, "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_top_level_help_lists_every_command():
    text = _help()
    for name in _subparsers():
        assert name in text


@pytest.mark.parametrize("name", sorted(set(_subparsers()) - set(DELEGATED)))
def test_command_help_lists_every_option_with_its_meaning(name):
    text = _help(name)
    assert text.startswith(f"usage: moerl {name}")
    for action in _subparsers()[name]._actions:
        assert action.help, f"moerl {name} {action.option_strings}: no help text"
        for flag in action.option_strings:
            assert flag in text


@pytest.mark.parametrize("name", sorted(DELEGATED))
def test_delegated_command_help(name):
    """Delegated commands own their parser (built inside their main); their help must still answer."""
    text = _help(name)
    assert text.startswith(f"usage: moerl {name}") and "--help" in text


def test_rl_help_lists_every_config_key():
    from rl_loop.config import RLConfig, SECTIONS

    text = _help("rl")
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for key in cls.__pydantic_fields__:
            assert f"\n  {key} = " in text.split(f"[{section}]", 1)[1]
    assert "\n  seed = 0  # " in text and RLConfig.__pydantic_fields__["seed"].description in text


def test_mismatch_served_weights_choices_are_the_librarys():
    """The parser keeps its own copy (importing rl_loop.mismatch means importing torch); it must not drift."""
    from typing import get_args

    from rl_loop.cli import SERVED_WEIGHTS
    from rl_loop.mismatch import ServedWeights

    assert SERVED_WEIGHTS == get_args(ServedWeights)
