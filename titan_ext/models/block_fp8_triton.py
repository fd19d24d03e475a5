"""The CUDA implementation of `block_fp8.quantize`: one Triton program per 128x128 block.

Each program reads its block once (bf16 or fp32), takes the block's amax, writes the block's
scale and its fp8 values. Memory-bound: the figure of merit is bytes moved (read 2 B, write
1 B per element for bf16) against the device's copy bandwidth (`benchmarks/fp8_export.py`).
Divisions use `div_rn` (IEEE round-to-nearest) so the scales equal torch's bit for bit; the
fp32 -> e4m3 cast is round-to-nearest-even with saturation on the GPU as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_fp8_format import AMAX_FLOOR, FP8, FP8_MAX, scale_shape


@triton.jit
def _block_quant_kernel(x_ptr, q_ptr, s_ptr, M, N, ROWS, COLS, BM: tl.constexpr, BN: tl.constexpr,
                        AMAX_MIN: tl.constexpr, QMAX: tl.constexpr):
    bn = tl.program_id(0)
    bm = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    r = bm * BM + tl.arange(0, BM)
    c = bn * BN + tl.arange(0, BN)
    mask = (r[:, None] < M) & (c[None, :] < N)
    offs = e * M * N + r[:, None].to(tl.int64) * N + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    a = tl.where(a != a, float("inf"), a)  # NaN -> inf: the scale becomes non-finite and is refused
    amax = tl.maximum(tl.max(tl.max(a, axis=1), axis=0), AMAX_MIN)
    scale_inv = tl.math.div_rn(amax, QMAX)
    inv = tl.math.div_rn(1.0, scale_inv)
    y = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + e * ROWS * COLS + bm * COLS + bn, scale_inv)


def quantize_cuda(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale_inv) of a contiguous [m, n] or [e, m, n] tensor (CUDA, or CPU under TRITON_INTERPRET=1)."""
    w = w.contiguous()
    m, n = w.shape[-2:]
    lead = w.shape[:-2]
    experts = w.numel() // (m * n) if m * n else 0
    rows, cols = scale_shape(w.shape, block)[-2:]
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty((*lead, rows, cols), dtype=torch.float32, device=w.device)
    if experts:
        _block_quant_kernel[(cols, rows, experts)](w, q, s, m, n, rows, cols, BM=block[0], BN=block[1],
                                                    AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, num_warps=8)
    return q, s
