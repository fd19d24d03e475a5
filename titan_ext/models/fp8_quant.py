"""Row-wise fp8 (e4m3) quantisation for the fp8 expert GEMMs (`fp8_experts.py`).

`torch._scaled_mm` multiplies fp8 operands and dequantises with float32 scales
(`x ~= q * scale`): one scale per row of the left operand and one per column of the right
one. Two layouts are needed:

- rows: one scale per row, same layout (activations as the left operand; weights as the
  right one, whose columns are the stored rows of the weight). The SwiGLU forward and
  backward are fused into their row quantisation (`swiglu_quant_rows`, `swiglu_bwd_quant_rows`);
- cols (`quant_cols_t`): one scale per (group, column) over that group's rows, written
  transposed so the contraction dimension is contiguous: both operands of an expert's weight
  gradient (contraction over its routed rows), and the transposed weights of the input
  gradient. Each group's block starts at a multiple of `COL_ALIGN` and is zero-padded to
  one: on the H200, Kimi-K2's per-expert weight-gradient GEMMs ran at 660-780 TFLOP/s on
  blocks at 16-row offsets (a first probe) and 1200-1250 on 128-aligned ones (--fp8-probe).

On CUDA each is one Triton pass (cols reads its input twice: amax, then quantise); without
Triton (CPU) the same math runs in torch. Tests run both under Triton's interpreter.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds: the torch formulation serves
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
COL_ALIGN = 128
# A zero row/column (padding, empty experts) gets this amax: q = 0, no division by zero.
_MIN_AMAX = 1e-12


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1).clamp_min(_MIN_AMAX) / FP8_MAX
    return (x / scale[:, None]).to(FP8), scale


def _swiglu(g13: torch.Tensor) -> torch.Tensor:
    g1, g3 = g13.float().chunk(2, dim=1)
    return F.silu(g1) * g3


def quant_rows(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, C] fp8, scale [R] fp32) with x[r] ~= q[r] * scale[r]."""
    if not _use_triton(x_RC):
        return _rows_torch(x_RC.float())
    x_RC = x_RC.contiguous()
    r, c = x_RC.shape
    q, scale = _rows_out(r, c, x_RC.device)
    _quant_rows_kernel[(r,)](x_RC, q, scale, c, BLOCK_C=triton.next_power_of_2(c), num_warps=8)
    return q, scale


def swiglu_quant_rows(g13_RF2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(g1) * g3 of g13 = [g1 | g3], quantised by rows: (q [R, F], scale [R])."""
    if not _use_triton(g13_RF2):
        return _rows_torch(_swiglu(g13_RF2))
    r, f = g13_RF2.size(0), g13_RF2.size(1) // 2
    q, scale = _rows_out(r, f, g13_RF2.device)
    _swiglu_rows_kernel[(r,)](g13_RF2.contiguous(), q, scale, f, BLOCK_F=triton.next_power_of_2(f), num_warps=8)
    return q, scale


def swiglu_bwd_quant_rows(dh_RF: torch.Tensor, g13_RF2: torch.Tensor):
    """Backward of h = silu(g1) * g3: dg13 = [dh g3 silu'(g1) | dh silu(g1)] in dh's dtype, and
    dg13 (as rounded to that dtype) quantised by rows: (dg13 [R, 2F], q [R, 2F], scale [R])."""
    if not _use_triton(dh_RF):
        g1, g3 = g13_RF2.float().chunk(2, dim=1)
        s = torch.sigmoid(g1)
        dh = dh_RF.float()
        dg13 = torch.cat([dh * g3 * s * (1 + g1 * (1 - s)), dh * g1 * s], dim=1).to(dh_RF.dtype)
        return (dg13, *_rows_torch(dg13.float()))
    r, f = dh_RF.shape
    dg13 = torch.empty(r, 2 * f, dtype=dh_RF.dtype, device=dh_RF.device)
    q, scale = _rows_out(r, 2 * f, dh_RF.device)
    _swiglu_bwd_rows_kernel[(r,)](dh_RF.contiguous(), g13_RF2.contiguous(), dg13, q, scale, f,
                                  BLOCK_F=triton.next_power_of_2(f), num_warps=8)
    return dg13, q, scale


def _rows_out(r: int, c: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(r, c, dtype=FP8, device=device), torch.empty(r, dtype=torch.float32, device=device)


def padded_starts(counts: list[int]) -> list[int]:
    """Start of each group in `quant_cols_t`'s output rows (groups padded to COL_ALIGN), then the total."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + -(-c // COL_ALIGN) * COL_ALIGN)
    return starts


def quant_cols_t(x_RC: torch.Tensor, counts: list[int], swiglu: bool = False,
                 stacked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group column-wise quantisation, transposed; group g is the next counts[g] rows of x.

    Returns (q, scale [G, C] fp32 = amax of the group's column / 448):
    - stacked=False: q [C, P] with P = padded_starts(counts)[-1]; group g occupies columns
      [p_g, p_g + counts[g]) and zeros up to p_{g+1} (q[c, p_g + i] = x[start_g + i, c] / scale[g, c]);
    - stacked=True (equal groups n, a weight [G*n, C]): q [G, C, n], each group's block transposed.
    swiglu=True: x is g13 = [g1 | g3] and h = silu(g1) * g3 is quantised (C = half its width).
    """
    c = x_RC.size(1) // 2 if swiglu else x_RC.size(1)
    g = len(counts)
    starts = padded_starts(counts)
    if not _use_triton(x_RC):
        xf = _swiglu(x_RC) if swiglu else x_RC.float()
        q = torch.zeros((g, c, counts[0]) if stacked else (c, starts[-1]), dtype=FP8, device=x_RC.device)
        scales, s0 = [], 0
        for i, n in enumerate(counts):
            blk = xf[s0:s0 + n]
            sc = (blk.abs().amax(dim=0) if n else xf.new_zeros(c)).clamp_min(_MIN_AMAX) / FP8_MAX
            scales.append(sc)
            qt = (blk / sc).t().to(FP8)
            if stacked:
                q[i] = qt
            else:
                q[:, starts[i]:starts[i] + n] = qt
            s0 += n
        return q, torch.stack(scales)
    dev = x_RC.device
    rows = torch.tensor([starts, [0, *itertools.accumulate(counts)]], dtype=torch.int64).to(dev)
    q = torch.empty((g, c, counts[0]) if stacked else (c, starts[-1]), dtype=FP8, device=dev)
    scale = torch.empty(g, c, dtype=torch.float32, device=dev)
    out_n = counts[0] if stacked else starts[-1]
    _quant_cols_t_kernel[(g, triton.cdiv(c, _COLS_BLOCK_C))](
        x_RC.contiguous(), rows, q, scale, c, x_RC.size(1), out_n, c * out_n if stacked else 0,
        G=g, STACKED=stacked, SWIGLU=swiglu, PAD=1 if stacked else COL_ALIGN,
        BLOCK_R=_COLS_BLOCK_R, BLOCK_C=_COLS_BLOCK_C, num_warps=8)
    return q, scale


# Fastest of six tile shapes on the H200 for [524288, 7168] (5.4 ms vs 7.5 for 64x64).
_COLS_BLOCK_R, _COLS_BLOCK_C = 256, 64

if triton is not None:

    @triton.jit
    def _quant_store(q_ptr, s_ptr, row, x, offs, mask):
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        tl.store(q_ptr + offs, (x / scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, C, BLOCK_C: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        x = tl.load(x_ptr + row * C + offs, mask=mask, other=0.0).to(tl.float32)
        _quant_store(q_ptr + row * C, s_ptr, row, x, offs, mask)

    @triton.jit
    def _silu_mul(g1, g3):
        return g1 * tl.sigmoid(g1) * g3

    @triton.jit
    def _swiglu_rows_kernel(g_ptr, q_ptr, s_ptr, F, BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_F)
        mask = offs < F
        g1 = tl.load(g_ptr + row * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
        g3 = tl.load(g_ptr + row * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
        _quant_store(q_ptr + row * F, s_ptr, row, _silu_mul(g1, g3), offs, mask)

    @triton.jit
    def _swiglu_bwd_rows_kernel(dh_ptr, g_ptr, dg_ptr, q_ptr, s_ptr, F, BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_F)
        mask = offs < F
        g1 = tl.load(g_ptr + row * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
        g3 = tl.load(g_ptr + row * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row * F + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g1)
        dg1 = (dh * g3 * s * (1 + g1 * (1 - s))).to(dg_ptr.dtype.element_ty)
        dg3 = (dh * g1 * s).to(dg_ptr.dtype.element_ty)
        tl.store(dg_ptr + row * 2 * F + offs, dg1, mask=mask)
        tl.store(dg_ptr + row * 2 * F + F + offs, dg3, mask=mask)
        a1, a3 = dg1.to(tl.float32), dg3.to(tl.float32)
        scale = tl.maximum(tl.maximum(tl.max(tl.abs(a1), axis=0), tl.max(tl.abs(a3), axis=0)), 1e-12) / 448.0
        tl.store(q_ptr + row * 2 * F + offs, (a1 / scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + row * 2 * F + F + offs, (a3 / scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _load_cols(x_ptr, rows, cols, m, C, X_STRIDE, SWIGLU: tl.constexpr):
        base = x_ptr + rows[:, None] * X_STRIDE + cols[None, :]
        x = tl.load(base, mask=m, other=0.0).to(tl.float32)
        if SWIGLU:
            x = _silu_mul(x, tl.load(base + C, mask=m, other=0.0).to(tl.float32))
        return x

    @triton.jit
    def _quant_cols_t_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, C, X_STRIDE, OUT_N, GROUP_STRIDE, G: tl.constexpr,
                             STACKED: tl.constexpr, SWIGLU: tl.constexpr, PAD: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # rows_ptr: [2, G+1] int64: padded output starts, then input row starts (cumulative counts).
        g = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        start = tl.load(rows_ptr + G + 1 + g)
        end = tl.load(rows_ptr + G + 2 + g)
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            x = _load_cols(x_ptr, rows, cols, (rows < end)[:, None] & cmask[None, :], C, X_STRIDE, SWIGLU)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0
        tl.store(s_ptr + g * C + cols, scale, mask=cmask)
        if STACKED:
            out0 = g.to(tl.int64) * GROUP_STRIDE
        else:
            out0 = tl.load(rows_ptr + g)
        pend = start + (end - start + PAD - 1) // PAD * PAD  # the zero padding is written too
        for r0 in range(start, pend, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            x = _load_cols(x_ptr, rows, cols, (rows < end)[:, None] & cmask[None, :], C, X_STRIDE, SWIGLU)
            q = tl.trans((x / scale[None, :]).to(q_ptr.dtype.element_ty))
            ptrs = q_ptr + out0 + cols[:, None].to(tl.int64) * OUT_N + (rows - start)[None, :]
            tl.store(ptrs, q, mask=cmask[:, None] & (rows < pend)[None, :])
