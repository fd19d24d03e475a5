"""titan_ext's Triton kernels against their torch references, under Triton's interpreter on CPU.

The cases live in `tests/unit/*_kernel_cases.py` (`benchmarks.gpu_check` runs the same files on a
CUDA GPU). They run here in one fresh process, all files together: TRITON_INTERPRET must be set
before Triton is first imported, which other tests of this session do, and one process pays the
imports of torch, Triton and TorchTitan once instead of once per file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Each file and the cases it holds: all of them must run and pass, none skipped.
CASES = {
    "sparse_mla_kernel_cases.py": 4,  # DSA sparse latent attention, forward and backward
    "cp_kernel_cases.py": 4,  # the context-parallel indexer scores and sparse attention at global positions
    "block_fp8_kernel_cases.py": 2,  # block-fp8 weight quantisation
    "fp8_quant_kernel_cases.py": 11,  # the fp8 experts' activation and weight quantisation
    "lean_dispatch_kernel_cases.py": 3,  # the lean token dispatcher's gather-sum and combine backward
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[dict[str, Counter], str]:
    """(file name -> Counter of its cases' outcomes: passed, failure, error, skipped; the run's output tail)."""
    report = tmp_path_factory.mktemp("interpreted") / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          *(str(ROOT / "tests" / "unit" / name) for name in CASES)],
                         env=dict(os.environ, TRITON_INTERPRET="1"), cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    output = run.stdout[-6000:] + run.stderr[-2000:]
    assert report.exists(), output
    found: dict[str, Counter] = {name: Counter() for name in CASES}
    for case in ET.parse(report).iter("testcase"):
        # a file that fails to import is one error case without a module name: counted apart, so it shows
        module = next((part for part in case.get("classname", "").split(".") if part.endswith("_kernel_cases")), None)
        key = f"{module}.py" if module else f"unattributed: {case.get('classname')!r}::{case.get('name')}"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        found.setdefault(key, Counter())[outcome] += 1
    return found, output


def test_every_kernel_case_file_is_run_here():
    """A new `*_kernel_cases.py` (which `benchmarks.gpu_check` picks up by name) runs here too."""
    assert set(CASES) == {p.name for p in Path(__file__).parent.glob("*_kernel_cases.py")}


def test_every_interpreted_case_belongs_to_a_listed_file(outcomes):
    found, output = outcomes
    assert set(found) == set(CASES), ({k: dict(v) for k, v in found.items() if k not in CASES}, output)


@pytest.mark.parametrize("name", CASES)
def test_kernel_cases_pass_under_the_interpreter(outcomes, name):
    found, output = outcomes
    assert found[name] == Counter(passed=CASES[name]), (dict(found[name]), output)
