"""torchtitan 0.3.0's expert-parallel dispatcher calls `torch.compiler._is_non_strict_tracing()`, absent from torch 2.11.

`AllToAllTokenDispatcher` asks it (beside `is_compiling()`) before every all-to-all
to choose functional collectives over spmd_types ones, so on the H200 machines
(torch 2.11 + CUDA 13) any EP > 1 forward dies with AttributeError. torch 2.13
answers from a flag that only its non-strict make_fx tracing sets; torch 2.11 has
no such tracing mode, so the stand-in answers False, which is what 2.13 answers
outside that mode.
"""

from __future__ import annotations

import torch.compiler

from . import Patch


def _is_non_strict_tracing() -> bool:
    """Stand-in: torch 2.11 has no non-strict make_fx tracing session to be inside."""
    return False


def _needed() -> bool:
    return not hasattr(torch.compiler, "_is_non_strict_tracing")


def _probe() -> str | None:
    if hasattr(torch.compiler, "is_compiling"):
        return None
    return "torch.compiler has no is_compiling, the dispatcher's other question"


def _apply() -> None:
    torch.compiler._is_non_strict_tracing = _is_non_strict_tracing


PATCH = Patch(
    name="torch_compiler_is_non_strict_tracing",
    target="torch.compiler:_is_non_strict_tracing",
    versions="torch>=2.11,<2.14",
    upstream="torchtitan 0.3.0 on torch 2.11 (added to torch.compiler after 2.11; present in 2.13)",
    symptom="AttributeError: module 'torch.compiler' has no attribute '_is_non_strict_tracing' (EP > 1 dispatch)",
    probe=_probe,
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
