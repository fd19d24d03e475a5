"""The Triton sparse latent attention (DSA) kernels, under Triton's interpreter on CPU.

The cases live in `sparse_mla_kernel_cases.py` (which `benchmarks.gpu_check` runs on a CUDA GPU);
they run here in a fresh process because TRITON_INTERPRET must be set before Triton is first
imported, and earlier tests of the same session import it.
"""

from pathlib import Path

from tests.conftest import run_interpreted_cases

HERE = Path(__file__).parent


def test_triton_kernels_match_torch_under_the_interpreter():
    run_interpreted_cases(HERE / "sparse_mla_kernel_cases.py", 4)
