"""The context-parallel Triton paths (indexer scores, sparse attention at global positions) under
Triton's interpreter on CPU; the cases live in `cp_kernel_cases.py` (fresh process, as
test_sparse_mla_triton.py explains)."""

from pathlib import Path

from tests.conftest import run_interpreted_cases

HERE = Path(__file__).parent


def test_cp_triton_paths_match_torch_under_the_interpreter():
    run_interpreted_cases(HERE / "cp_kernel_cases.py", 4)
