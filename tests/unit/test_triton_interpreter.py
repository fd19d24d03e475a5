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
    assert report.exists(), run.stdout[-6000:] + run.stderr[-2000:]
    found: dict[str, Counter] = {name: Counter() for name in CASES}
    for case in ET.parse(report).iter("testcase"):
        module = next(part for part in case.get("classname", "").split(".") if part.endswith("_kernel_cases"))
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        found[module + ".py"][outcome] += 1
    return found, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.parametrize("name", CASES)
def test_kernel_cases_pass_under_the_interpreter(outcomes, name):
    found, output = outcomes
    assert found[name] == Counter(passed=CASES[name]), (dict(found[name]), output)
