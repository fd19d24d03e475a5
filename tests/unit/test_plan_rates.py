"""The measured rates `moerl plan` ships (rl_loop/plan/measured) are the benchmarks' results, byte for byte.

One source of truth: a benchmark writes benchmarks/results/*.json; the plan's copies must follow it,
or an installed `moerl plan` would quote a run that is no longer the one on record.
"""

from __future__ import annotations

import tomllib

from rl_loop.plan.rates import READ, SHIPPED
from tests.conftest import ROOT

BENCHMARK_RESULTS = ROOT / "benchmarks" / "results"


def test_the_shipped_rates_are_the_files_a_plan_reads():
    assert sorted(p.name for p in SHIPPED.glob("*.json")) == sorted(READ)


def test_the_shipped_rates_equal_the_benchmark_results():
    stale = [name for name in READ if (SHIPPED / name).read_bytes() != (BENCHMARK_RESULTS / name).read_bytes()]
    assert stale == [], (f"rl_loop/plan/measured differs from benchmarks/results for {stale}: copy them over "
                         f"(cp benchmarks/results/<name> rl_loop/plan/measured/), see rl_loop/plan/rates.py")


def test_the_shipped_rates_are_package_data():
    """Declared in pyproject.toml, so a wheel carries them (an installed `moerl plan` has no benchmarks/)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["rl_loop.plan"]
    package = SHIPPED.parent
    declared = {p.name for g in globs for p in package.glob(g)}
    assert declared >= set(READ), f"not declared as package data of rl_loop.plan: {sorted(set(READ) - declared)}"
