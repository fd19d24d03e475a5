"""torch 2.13's meta (fake-tensor) kernel of `aten._grouped_mm` accepts only bf16 operands; its CPU kernel also
computes fp32 and fp16.

titan_ext's routed experts compute in their input dtype (fp32 on CPU, for parity), so
compiling an MoE block in fp32 (`--compile.enable`, which
`activation-checkpoint:memory-budget` requires) dies while tracing, before anything runs.
For unscaled fp32/fp16 operands the patched meta kernel returns the output the stock one
would (shape and strides from the same helper) in the operands' dtype, as the kernel does;
it skips the stock checks, which are the CUDA kernel's (bf16, 16-byte strides): the CPU
kernel checks shapes itself when it runs. Every other call goes to the stock kernel.
"""

from __future__ import annotations

import torch
import torch._meta_registrations as meta

from . import Patch, probe_target

_STOCK = meta._meta_grouped_mm_common
_WIDENED = (torch.float32, torch.float16)


def _meta_grouped_mm_common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                            out_dtype=None, use_fast_accum=False):
    if scale_a is None and out_dtype is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in _WIDENED:
        return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, None)
    return _STOCK(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)


def fp32_meta_error() -> str | None:
    """The meta kernel's error for fp32 operands (None when it accepts them)."""
    a, b = torch.empty(8, 4, device="meta"), torch.empty(2, 4, 3, device="meta")
    try:
        torch._grouped_mm(a, b, offs=torch.empty(2, dtype=torch.int32, device="meta"))
    except RuntimeError as e:
        return str(e)
    return None


def _needed() -> bool:
    return fp32_meta_error() is not None


_PARAMS = ["mat_a", "mat_b", "scale_a", "scale_b", "offs", "bias", "scale_result", "out_dtype", "use_fast_accum"]


def _probe() -> str | None:
    if not hasattr(meta, "_create_grouped_mm_output_tensor"):
        return "torch._meta_registrations has no _create_grouped_mm_output_tensor"
    return probe_target("torch._meta_registrations:_meta_grouped_mm_common", _PARAMS)()


def _apply() -> None:
    meta._meta_grouped_mm_common = _meta_grouped_mm_common


PATCH = Patch(
    name="torch_grouped_mm_meta_dtype",
    target="torch._meta_registrations:_meta_grouped_mm_common",
    versions="torch>=2.11,<2.14",
    upstream="torch 2.13 (meta kernel of aten._grouped_mm: bf16 only)",
    symptom="torch.compile of an fp32 MoE block: RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float32",
    probe=_probe,
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
