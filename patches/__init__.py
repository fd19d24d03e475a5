"""Small, named runtime patches for gaps between the upstream versions we build on.

Each module here fixes one gap, says which upstream version it targets and what
breaks without it, and knows how to tell whether it is still needed. `apply_all()`
applies the needed ones and is idempotent (every process that imports titan_ext
calls it). tests/unit/test_patches.py fails as soon as upstream no longer needs a
patch, so dead patches get deleted instead of accumulating.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str
    upstream: str
    symptom: str
    needed: Callable[[], bool]
    apply: Callable[[], None]


PATCH_MODULES = (
    # First: torchtitan cannot even be imported on torch 2.11 without it.
    "patches.torch_fsdp_data_parallel_mesh_dims",
    "patches.torch_compiler_is_non_strict_tracing",
    "patches.torch_distributed_set_timeout",
    "patches.torchtitan_cpu_device",
    "patches.fsdp_gloo_sum_reduction",
    "patches.torch_grouped_mm_meta_dtype",
    "patches.vllm_cpu_moe_reload_prepack",
    "patches.vllm_cpu_mla_rope",
    "patches.vllm_executor_reads_every_answer",
)


def all_patches() -> list[Patch]:
    return [importlib.import_module(m).PATCH for m in PATCH_MODULES]


def apply_all() -> list[str]:
    """Apply every patch that is still needed; returns the names applied now."""
    applied = []
    for patch in all_patches():
        if patch.needed():
            patch.apply()
            applied.append(patch.name)
    return applied
