"""The Triton sparse latent attention (DSA) kernels, under Triton's interpreter on CPU.

The cases live in `sparse_mla_interpreted_cases.py`; they run here in a fresh process because
TRITON_INTERPRET must be set before Triton is first imported, and earlier tests of the same
session import it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_triton_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "sparse_mla_interpreted_cases.py")],
                         env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert re.search(r"\b4 passed\b", run.stdout), run.stdout[-2000:]  # every case ran, none skipped
