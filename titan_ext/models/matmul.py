"""Batched matmul with an fp32 result, for the DSA kernels.

16-bit inputs keep their bandwidth advantage while the products accumulate and
land in fp32, as the reference implementations compute them.
"""

from __future__ import annotations

import torch

_BMM_OUT_DTYPE = [True]  # does this torch/device have bmm(..., out_dtype=float32) for 16-bit inputs?


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (fp32 accumulation on every device)."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda and torch.compiler.is_compiling():
        return torch.bmm(a, b, out_dtype=torch.float32)
    if a.is_cuda and _BMM_OUT_DTYPE[0]:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _BMM_OUT_DTYPE[0] = False
    if a.is_cuda:
        return torch.bmm(a, b).float()  # fp32 accumulation, 16-bit rounding of the result
    return torch.bmm(a.float(), b.float())
