"""Row-wise fp8 (e4m3) quantisation for the fp8 expert GEMMs (`fp8_experts.py`).

`torch._scaled_mm` multiplies fp8 operands and dequantises with float32 scales
(`x ~= q * scale`): one scale per row of the left operand and one per column of the right
one. Three layouts are made:

- rows (`quant_rows`): one scale per row, same layout (activations as the left operand;
  weights as the right one, whose columns are the stored rows of the weight). The SwiGLU
  forward and backward are fused into their row quantisation (`swiglu_quant_rows`,
  `swiglu_bwd_quant_rows`; the backward also applies the routing score, returns the score
  gradient and h's column maxima). W1 and W3 are read as one [2F, D] weight per expert
  without being concatenated (`interleave`);
- grouped and transposed, moved not re-quantised (`transpose_groups`): a routed row's scale
  is its token's, so the tokens (x forward, the block's output gradient g backward) are
  quantised once by rows and one pass gathers their fp8 rows into the routed layout (a GEMM's
  left operand, with the gathered scales) and writes them transposed per group (a weight
  gradient's operand). Such an operand keeps its row scales, which the weight gradient's
  other operand takes instead: dW_e = sum_r (a[r] s[r])^T q[r], a quantised by columns with
  mul = s;
- cols (`quant_cols_t`): one scale per (group, column) over that group's rows, written
  transposed so the contraction dimension is contiguous: the scaled operand of each weight
  gradient (contraction over the expert's routed rows: dg13, and h recomputed from g13), and
  the transposed weights of the input gradient. Each group's block starts at a multiple of
  `COL_ALIGN` and is zero-padded to one (as in `transpose_groups`): on the H200, Kimi-K2's
  per-expert weight-gradient GEMMs ran at 660-780 TFLOP/s on blocks at 16-row offsets (a
  first probe) and 1200-1250 on 128-aligned ones (--fp8-probe).

The column pass takes its scales from column maxima that a row pass over the same rows
wrote per block of `ROW_BLOCK` rows (`Rows.colmax`: max |v[r]| * mul[r]), so it reads its
input once (it read it twice, amax then quantise, at 3.3 TB/s). Groups (experts) are
therefore multiples of `ROW_BLOCK` rows, which cuBLASLt's fp8 GEMMs need anyway.

On CUDA each pass is one Triton kernel; without Triton (CPU) the same math runs in torch.
Tests run both under Triton's interpreter.
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

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
ROW_BLOCK = 16
# A zero row/column (padding, empty experts) gets this amax: q = 0, no division by zero.
_MIN_AMAX = 1e-12


class Rows(NamedTuple):
    q: torch.Tensor  # [R, C] fp8
    scale: torch.Tensor  # [R] fp32: row r ~= q[r] * scale[r]
    # [R / ROW_BLOCK, C] fp32: max |v[r]| * colmul[r] per column and block of rows (colmul = 1 in quant_rows)
    colmax: torch.Tensor | None = None
    dot: torch.Tensor | None = None  # [R] fp32: swiglu_bwd_quant_rows' score gradient


class Grouped(NamedTuple):
    t: torch.Tensor  # [C, P] fp8: each group's rows transposed, at padded_starts, zero-padded
    q: torch.Tensor  # [R, C] fp8: the rows (gathered when a gather index was given)
    scale: torch.Tensor  # [R] fp32: their row scales


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _swiglu(g13: torch.Tensor) -> torch.Tensor:
    g1, g3 = g13.float().chunk(2, dim=1)
    return F.silu(g1) * g3


def _values(x, mul=None, swiglu=False, interleave=None) -> torch.Tensor:
    """The fp32 rows a quantisation sees (torch formulation): x's rows (swiglu'd) * mul[r];
    with interleave = (x2, n) the rows of x and x2 taken alternately n at a time."""
    if interleave is not None:
        x2, n = interleave
        x = torch.cat([x.reshape(-1, n, x.size(1)), x2.reshape(-1, n, x.size(1))], dim=1).reshape(-1, x.size(1))
    v = _swiglu(x) if swiglu else x.float()
    return v if mul is None else v * mul.float()[:, None]


def _colmax(a: torch.Tensor, colmul=None) -> torch.Tensor:
    """max over each ROW_BLOCK rows of a[r] * colmul[r] (torch formulation)."""
    return (a if colmul is None else a * colmul.float()[:, None]).view(-1, ROW_BLOCK, a.size(1)).amax(dim=1)


def _rows_torch(v: torch.Tensor, colmul=None, colmax=True, dot=None) -> Rows:
    a = v.abs()
    scale = a.amax(dim=1).clamp_min(_MIN_AMAX) / FP8_MAX
    return Rows((v / scale[:, None]).to(FP8), scale, _colmax(a, colmul) if colmax else None, dot)


def _check_rows(r: int) -> None:
    if r % ROW_BLOCK:
        raise ValueError(f"{r} rows: fp8 quantisation takes multiples of {ROW_BLOCK} rows")


def _interleave_args(x_TC, interleave, block: int):
    """(n, x2's offset from x in elements) of `interleave` for a kernel (0, 0 when None) and the
    row count; the kernels read x or x2 by blocks of `block` rows, so n must be a multiple of it."""
    if interleave is None:
        return 0, 0, x_TC.size(0)
    x2, n = interleave
    if x2.shape != x_TC.shape or x2.dtype != x_TC.dtype or x_TC.size(0) % n or n % block:
        raise ValueError(f"interleave: x2 must be like x, n must divide its rows and be a multiple of {block}")
    if not (x_TC.is_contiguous() and x2.is_contiguous()):
        raise ValueError("interleave: x and x2 must be contiguous")
    delta, rem = divmod(x2.data_ptr() - x_TC.data_ptr(), x_TC.element_size())
    assert rem == 0
    return n, delta, 2 * x_TC.size(0)


def quant_rows(x_TC: torch.Tensor, colmax: bool = True, interleave: tuple[torch.Tensor, int] | None = None) -> Rows:
    """x's rows quantised.

    colmax: also the column maxima of |x| per block of ROW_BLOCK rows, for `quant_cols_t`
    (then the rows must be a multiple of ROW_BLOCK; without, any row count: the tokens).
    interleave = (x2, n): the rows are x's first n rows, x2's first n, x's next n, ... (W1 and
    W3 as one [2F, D] weight per expert, without concatenating them).
    """
    n, delta, r = _interleave_args(x_TC, interleave, ROW_BLOCK)
    c = x_TC.size(1)
    if colmax:
        _check_rows(r)
    if not _use_triton(x_TC):
        return _rows_torch(_values(x_TC, interleave=interleave), colmax=colmax)
    q, scale, cm = _rows_out(r, c, x_TC.device, colmax)
    x_TC = x_TC.contiguous()
    _quant_rows_kernel[(triton.cdiv(r, ROW_BLOCK),)](
        x_TC, q, scale, x_TC if cm is None else cm, r, c, n, delta, PAIR=interleave is not None, COLMAX=colmax,
        ROW_BLOCK=ROW_BLOCK, P=_rows_per_step(c), BLOCK_C=triton.next_power_of_2(c), num_warps=8)
    return Rows(q, scale, cm)


def _rows_per_step(c: int) -> int:
    """Rows `_quant_rows_kernel` loads as one tile per step, by what was fastest on the H200:
    two for wide rows ([524288, 7168] through a gather index: 3.0 ms, one row per step 3.7);
    one for rows up to 2048 wide (W2's [E*7168, 2048]: 6.1 ms two at a time, 0.6 one row per
    program)."""
    return 1 if c <= 2048 else 2


def swiglu_quant_rows(g13_RF2: torch.Tensor) -> Rows:
    """h = silu(g1) * g3 of g13 = [g1 | g3], quantised by rows: q [R, F] (no column maxima: the
    backward's `swiglu_bwd_quant_rows` makes those for W2's weight gradient)."""
    r, f = g13_RF2.size(0), g13_RF2.size(1) // 2
    _check_rows(r)
    if not _use_triton(g13_RF2):
        return _rows_torch(_swiglu(g13_RF2), colmax=False)
    q, scale, _ = _rows_out(r, f, g13_RF2.device, False)
    _swiglu_rows_kernel[(r // ROW_BLOCK,)](g13_RF2.contiguous(), q, scale, f, ROW_BLOCK=ROW_BLOCK,
                                           BLOCK_F=triton.next_power_of_2(f), num_warps=8)
    return Rows(q, scale)


def swiglu_bwd_quant_rows(dh_RF: torch.Tensor, g13_RF2: torch.Tensor, colmul_R: torch.Tensor, hmul_R: torch.Tensor,
                          score_R: torch.Tensor | None = None) -> tuple[torch.Tensor, Rows, torch.Tensor]:
    """Backward of h = silu(g1) * g3, the output's gradient being score[r] * dh[r] (score = 1
    when None): dg13 = [dh' g3 silu'(g1) | dh' silu(g1)] with dh' = score * dh, in dh's dtype,
    and dg13 (as rounded to that dtype) quantised by rows with the column maxima of
    |dg13[r]| * colmul[r]. With a score, Rows.dot[r] = <dh[r], h[r]>: the gradient of score[r]
    when y = score * (h W2^T) and dh is the gradient of h W2^T.

    Also returns h's column maxima [R / ROW_BLOCK, F] of |h[r]| * hmul[r] (h recomputed from g13
    here), for `quant_cols_t(g13, ..., swiglu=True, mul_R=hmul)`.
    """
    r, f = dh_RF.shape
    _check_rows(r)
    if not _use_triton(dh_RF):
        g1, g3 = g13_RF2.float().chunk(2, dim=1)
        s = torch.sigmoid(g1)
        h = _swiglu(g13_RF2)
        dh = dh_RF.float()
        dot = None
        if score_R is not None:
            dot = (dh * h).sum(dim=1)
            dh = dh * score_R.float()[:, None]
        dg13 = torch.cat([dh * g3 * s * (1 + g1 * (1 - s)), dh * g1 * s], dim=1).to(dh_RF.dtype)
        return dg13, _rows_torch(dg13.float(), colmul_R, dot=dot), _colmax(h.abs(), hmul_R)
    dg13 = torch.empty(r, 2 * f, dtype=dh_RF.dtype, device=dh_RF.device)
    q, scale, cm = _rows_out(r, 2 * f, dh_RF.device, True)
    hmax = torch.empty(r // ROW_BLOCK, f, dtype=torch.float32, device=dh_RF.device)
    dot = torch.empty(r, dtype=torch.float32, device=dh_RF.device) if score_R is not None else None
    _swiglu_bwd_rows_kernel[(r // ROW_BLOCK,)](
        dh_RF.contiguous(), g13_RF2.contiguous(), dh_RF if score_R is None else score_R, colmul_R, hmul_R, dg13, q,
        scale, cm, hmax, dh_RF if dot is None else dot, f, SCORE=score_R is not None, ROW_BLOCK=ROW_BLOCK,
        BLOCK_F=triton.next_power_of_2(f), num_warps=_SWIGLU_BWD_WARPS)
    return dg13, Rows(q, scale, cm, dot), hmax


def _rows_out(r: int, c: int, device, colmax: bool):
    return (torch.empty(r, c, dtype=FP8, device=device), torch.empty(r, dtype=torch.float32, device=device),
            torch.empty(r // ROW_BLOCK, c, dtype=torch.float32, device=device) if colmax else None)


def padded_starts(counts: list[int]) -> list[int]:
    """Start of each group in the transposed layouts' columns (groups padded to COL_ALIGN), then the total."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + -(-c // COL_ALIGN) * COL_ALIGN)
    return starts


def transpose_groups(q_TC: torch.Tensor, counts: list[int], src_R: torch.Tensor | None = None,
                     scale_T: torch.Tensor | None = None) -> Grouped:
    """fp8 rows v[r] = q[src[r]] (q's own rows when src is None), group g the next counts[g]
    rows, moved into `quant_cols_t`'s transposed padded layout: t [C, P], group g at columns
    [p_g, p_g + counts[g]), zeros up to p_{g+1}. The values and scales stay the rows' own.

    With src: one pass also writes the gathered rows and their scales (scale_T[src[r]]);
    without, Grouped.q and .scale are q and scale_T as given.
    """
    c = q_TC.size(1)
    starts = padded_starts(counts)
    dev = q_TC.device
    if not _use_triton(q_TC):
        rows = q_TC.view(torch.uint8) if src_R is None else q_TC.view(torch.uint8).index_select(0, src_R)
        t = torch.zeros(c, starts[-1], dtype=torch.uint8, device=dev)
        s0 = 0
        for i, n in enumerate(counts):
            t[:, starts[i]:starts[i] + n] = rows[s0:s0 + n].t()
            s0 += n
        if src_R is None:
            return Grouped(t.view(FP8), q_TC, scale_T)
        return Grouped(t.view(FP8), rows.view(FP8), scale_T.index_select(0, src_R))
    g = len(counts)
    table = _device_table([starts, [0, *itertools.accumulate(counts)]], dev)
    t = torch.empty(c, starts[-1], dtype=FP8, device=dev)
    q = q_TC.contiguous()
    rows_q = rows_s = None
    if src_R is not None:
        rows_q = torch.empty(src_R.numel(), c, dtype=FP8, device=dev)
        rows_s = torch.empty(src_R.numel(), dtype=torch.float32, device=dev)
    block_r, block_c = _T_TILE[src_R is not None]
    _transpose_groups_kernel[(g, triton.cdiv(c, block_c))](
        q.view(torch.uint8), q if scale_T is None else scale_T, q if src_R is None else src_R, table,
        q if rows_q is None else rows_q.view(torch.uint8), q if rows_s is None else rows_s, t.view(torch.uint8),
        c, starts[-1], G=g, GATHER=src_R is not None, PAD=COL_ALIGN, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    if src_R is None:
        return Grouped(t, q_TC, scale_T)
    return Grouped(t, rows_q, rows_s)


def quant_cols_t(x_TC: torch.Tensor, counts: list[int], colmax: torch.Tensor, stacked: bool = False,
                 mul_R: torch.Tensor | None = None, swiglu: bool = False,
                 interleave: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group column-wise quantisation, transposed, of the rows v[r] * mul[r], where v are x's
    rows (swiglu=True: h = silu(g1) * g3 of x = g13 = [g1 | g3]; interleave as in `quant_rows`)
    and `colmax` their column maxima of |v[r]| * mul[r] per ROW_BLOCK rows (from a row pass);
    group g is the next counts[g] rows (each a multiple of ROW_BLOCK).

    Returns (q, scale [G, C] fp32 = max |v * mul| over the group's rows / 448):
    - stacked=False: q [C, P] with P = padded_starts(counts)[-1]; group g occupies columns
      [p_g, p_g + counts[g]) and zeros up to p_{g+1} (q[c, p_g + i] = v[start_g + i, c] * mul / scale[g, c]);
    - stacked=True (equal groups n, a weight [G*n, C]): q [G, C, n], each group's block transposed.
    """
    c = x_TC.size(1) // 2 if swiglu else x_TC.size(1)
    g = len(counts)
    for n in counts:
        _check_rows(n)
    starts = padded_starts(counts)
    bounds = [0, *itertools.accumulate(n // ROW_BLOCK for n in counts)]
    if not _use_triton(x_TC):
        v = _values(x_TC, mul_R, swiglu, interleave)
        q = torch.zeros((g, c, counts[0]) if stacked else (c, starts[-1]), dtype=FP8, device=x_TC.device)
        scales, s0 = [], 0
        for i, n in enumerate(counts):
            blocks = colmax[bounds[i]:bounds[i + 1]]
            sc = (blocks.amax(dim=0) if n else blocks.new_zeros(c)).clamp_min(_MIN_AMAX) / FP8_MAX
            scales.append(sc)
            qt = (v[s0:s0 + n] / sc).t().to(FP8)
            if stacked:
                q[i] = qt
            else:
                q[:, starts[i]:starts[i] + n] = qt
            s0 += n
        return q, torch.stack(scales)
    dev = x_TC.device
    block_r, block_c, warps = _COLS_TILE[swiglu]
    split, delta, _ = _interleave_args(x_TC, interleave, block_r)
    rows = _device_table([starts, [0, *itertools.accumulate(counts)]], dev)
    q = torch.empty((g, c, counts[0]) if stacked else (c, starts[-1]), dtype=FP8, device=dev)
    scale = torch.empty(g, c, dtype=torch.float32, device=dev)
    out_n = counts[0] if stacked else starts[-1]
    x_TC = x_TC.contiguous()
    _quant_cols_t_kernel[(g, triton.cdiv(c, block_c))](
        x_TC, x_TC if mul_R is None else mul_R, colmax, rows, q, scale, c, x_TC.size(1), split, delta, out_n,
        c * out_n if stacked else 0, G=g, PAIR=interleave is not None, MUL=mul_R is not None, STACKED=stacked,
        SWIGLU=swiglu, PAD=1 if stacked else COL_ALIGN, ROW_BLOCK=ROW_BLOCK, BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_B=_COLS_BLOCK_B, num_warps=warps)
    return q, scale


def _device_table(rows: list[list[int]], device) -> torch.Tensor:
    """A small int64 table on `device` without a device sync (a pageable host copy waits for the
    stream; a pinned one does not)."""
    t = torch.tensor(rows, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# (rows, columns, warps) by swiglu: fastest of seven on the H200 at Kimi-K2's 64k tokens: dg13 [524288, 4096]
# 2.43 ms (32x128: 2.74, 64x64: 2.56); h from g13 [524288, 4096] 1.99 ms (64x128: 3.84, 64x64: 2.39).
_COLS_TILE = {False: (64, 128, 4), True: (32, 64, 4)}
_SWIGLU_BWD_WARPS = 8  # 4.72 ms at Kimi-K2's 64k tokens (4 warps: 4.79, 16: 4.88; two rows per step: 5.6+)
_COLS_BLOCK_B = 64  # column-maximum blocks reduced per step
# transpose_groups' tile (rows, columns of fp8 bytes) by gather, fastest of up to eleven on the H200 (4 warps):
# gathered [524288, 7168] 3.43-3.47 ms (64x128: 3.94, 128x128: 12.3, 512x32: 3.77), in place [524288, 2048]
# 0.66 ms (64x128: 0.87).
_T_TILE = {True: (256, 64), False: (128, 128)}

if triton is not None:

    @triton.jit
    def _pair_shift(r0, SPLIT, X2_DELTA, X_STRIDE, PAIR: tl.constexpr):
        """Element offset from x's row r to the row it reads, for rows r0.. of one SPLIT-row block:
        with PAIR the rows of x and x2 = x + X2_DELTA (elements) are taken alternately SPLIT at a
        time. One pointer plus a scalar offset: selecting between two pointers per block made the
        loads unvectorised (W1|W3's column pass ran 1.9 ms instead of 1.7 with the concatenation)."""
        if PAIR:
            half = r0 // SPLIT
            shift = (half // 2 - half) * SPLIT * X_STRIDE + (half % 2) * X2_DELTA
        else:
            shift = 0
        return shift

    @triton.jit
    def _group_span(rows_ptr, G: tl.constexpr, PAD: tl.constexpr):
        """Group program_id(0) of a transposed layout: its input rows [start, end), the end of
        their zero padding to a multiple of PAD, and its first output column. rows_ptr: [2, G+1]
        int64, the padded output starts (`padded_starts`), then the input row starts."""
        g = tl.program_id(0)
        start = tl.load(rows_ptr + G + 1 + g)
        end = tl.load(rows_ptr + G + 2 + g)
        pend = start + (end - start + PAD - 1) // PAD * PAD
        return start, end, pend, tl.load(rows_ptr + g)

    # The row kernels run one program per ROW_BLOCK rows (the block of one column-maximum row),
    # rows whole in registers; `_quant_rows_kernel` loads P rows per step as one tile, P chosen by
    # `_rows_per_step`.

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, cmax_ptr, R, C, SPLIT, X2_DELTA, PAIR: tl.constexpr,
                           COLMAX: tl.constexpr, ROW_BLOCK: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr):
        blk = tl.program_id(0).to(tl.int64)
        base = x_ptr + _pair_shift(blk * ROW_BLOCK, SPLIT, X2_DELTA, C, PAIR)
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        cmax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in range(0, ROW_BLOCK, P):
            r = blk * ROW_BLOCK + i + tl.arange(0, P).to(tl.int64)
            m = (r < R)[:, None] & mask[None, :]
            x = tl.load(base + r[:, None] * C + offs[None, :], mask=m, other=0.0).to(tl.float32)
            ax = tl.abs(x)
            scale = tl.maximum(tl.max(ax, axis=1), 1e-12) / 448.0
            tl.store(q_ptr + r[:, None] * C + offs[None, :], (x / scale[:, None]).to(q_ptr.dtype.element_ty), mask=m)
            tl.store(s_ptr + r, scale, mask=r < R)
            if COLMAX:
                cmax = tl.maximum(cmax, tl.max(ax, axis=0))
        if COLMAX:
            tl.store(cmax_ptr + blk * C + offs, cmax, mask=mask)

    @triton.jit
    def _quant_store(q_ptr, s_ptr, x, offs, mask):
        """Quantise row x (fp32, masked lanes 0) by its own amax."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        tl.store(q_ptr + offs, (x / scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr, scale)

    @triton.jit
    def _silu_mul(g1, g3):
        return g1 * tl.sigmoid(g1) * g3

    @triton.jit
    def _swiglu_rows_kernel(g_ptr, q_ptr, s_ptr, F, ROW_BLOCK: tl.constexpr, BLOCK_F: tl.constexpr):
        # Two rows loaded before either is reduced (1.35 ms for [524288, 4096] in; 1.5 one row at a time,
        # measured in another run).
        blk = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_F)
        mask = offs < F
        for i in range(0, ROW_BLOCK, 2):
            r = blk * ROW_BLOCK + i
            g1a = tl.load(g_ptr + r * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
            g3a = tl.load(g_ptr + r * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
            g1b = tl.load(g_ptr + (r + 1) * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
            g3b = tl.load(g_ptr + (r + 1) * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
            _quant_store(q_ptr + r * F, s_ptr + r, _silu_mul(g1a, g3a), offs, mask)
            _quant_store(q_ptr + (r + 1) * F, s_ptr + r + 1, _silu_mul(g1b, g3b), offs, mask)

    @triton.jit
    def _swiglu_bwd_rows_kernel(dh_ptr, g_ptr, score_ptr, colmul_ptr, hmul_ptr, dg_ptr, q_ptr, s_ptr, cmax_ptr,
                                hmax_ptr, dot_ptr, F, SCORE: tl.constexpr, ROW_BLOCK: tl.constexpr,
                                BLOCK_F: tl.constexpr):
        # One row per step (two or four as one tile ran 5.6-32 ms instead of 4.7 on the H200). The score
        # (its dot and multiply) costs 1.3 ms of the 4.7, h's column maxima 0.8.
        blk = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_F)
        mask = offs < F
        cmax1 = tl.zeros([BLOCK_F], dtype=tl.float32)
        cmax3 = tl.zeros([BLOCK_F], dtype=tl.float32)
        hmax = tl.zeros([BLOCK_F], dtype=tl.float32)
        for i in range(ROW_BLOCK):
            r = blk * ROW_BLOCK + i
            g1 = tl.load(g_ptr + r * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
            g3 = tl.load(g_ptr + r * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + r * F + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(g1)
            h = _silu_mul(g1, g3)  # as the column pass recomputes it
            hmax = tl.maximum(hmax, tl.abs(h) * tl.load(hmul_ptr + r))
            if SCORE:
                tl.store(dot_ptr + r, tl.sum(dh * h, axis=0))
                dh = dh * tl.load(score_ptr + r).to(tl.float32)
            dg1 = (dh * g3 * s * (1 + g1 * (1 - s))).to(dg_ptr.dtype.element_ty)
            dg3 = (dh * g1 * s).to(dg_ptr.dtype.element_ty)
            tl.store(dg_ptr + r * 2 * F + offs, dg1, mask=mask)
            tl.store(dg_ptr + r * 2 * F + F + offs, dg3, mask=mask)
            a1, a3 = tl.abs(dg1.to(tl.float32)), tl.abs(dg3.to(tl.float32))
            scale = tl.maximum(tl.max(tl.maximum(a1, a3), axis=0), 1e-12) / 448.0
            tl.store(q_ptr + r * 2 * F + offs, (dg1.to(tl.float32) / scale).to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(q_ptr + r * 2 * F + F + offs, (dg3.to(tl.float32) / scale).to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + r, scale)
            m = tl.load(colmul_ptr + r)
            cmax1 = tl.maximum(cmax1, a1 * m)
            cmax3 = tl.maximum(cmax3, a3 * m)
        tl.store(cmax_ptr + blk * 2 * F + offs, cmax1, mask=mask)
        tl.store(cmax_ptr + blk * 2 * F + F + offs, cmax3, mask=mask)
        tl.store(hmax_ptr + blk * F + offs, hmax, mask=mask)

    @triton.jit
    def _quant_cols_t_kernel(x_ptr, mul_ptr, cmax_ptr, rows_ptr, q_ptr, s_ptr, C, X_STRIDE, SPLIT, X2_DELTA, OUT_N,
                             GROUP_STRIDE, G: tl.constexpr, PAIR: tl.constexpr, MUL: tl.constexpr,
                             STACKED: tl.constexpr, SWIGLU: tl.constexpr, PAD: tl.constexpr,
                             ROW_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_B: tl.constexpr):
        g = tl.program_id(0)
        start, end, pend, col0 = _group_span(rows_ptr, G, PAD)  # the zero padding is written too
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for b0 in range(start // ROW_BLOCK, end // ROW_BLOCK, BLOCK_B):  # the row pass's column maxima
            b = b0 + tl.arange(0, BLOCK_B)
            m = (b < end // ROW_BLOCK)[:, None] & cmask[None, :]
            amax = tl.maximum(amax, tl.max(tl.load(cmax_ptr + b[:, None] * C + cols[None, :], mask=m, other=0.0),
                                           axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0
        tl.store(s_ptr + g * C + cols, scale, mask=cmask)
        if STACKED:
            out0 = g.to(tl.int64) * GROUP_STRIDE
        else:
            out0 = col0
        for r0 in range(start, pend, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < end
            m = rmask[:, None] & cmask[None, :]
            ptrs = x_ptr + _pair_shift(r0, SPLIT, X2_DELTA, X_STRIDE, PAIR) + rows[:, None] * X_STRIDE + cols[None, :]
            x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
            if SWIGLU:
                x = _silu_mul(x, tl.load(ptrs + C, mask=m, other=0.0).to(tl.float32))
            if MUL:
                x = x * tl.load(mul_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            q = tl.trans((x / scale[None, :]).to(q_ptr.dtype.element_ty))
            ptrs = q_ptr + out0 + cols[:, None].to(tl.int64) * OUT_N + (rows - start)[None, :]
            tl.store(ptrs, q, mask=cmask[:, None] & (rows < pend)[None, :])

    @triton.jit
    def _transpose_groups_kernel(q_ptr, s_ptr, src_ptr, rows_ptr, out_q_ptr, out_s_ptr, t_ptr, C, OUT_N,
                                 G: tl.constexpr, GATHER: tl.constexpr, PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
        # Bytes only (fp8 as uint8).
        start, end, pend, out0 = _group_span(rows_ptr, G, PAD)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        for r0 in range(start, pend, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < end
            if GATHER:
                src = tl.load(src_ptr + rows, mask=rmask, other=0).to(tl.int64)
            else:
                src = rows
            m = rmask[:, None] & cmask[None, :]
            v = tl.load(q_ptr + src[:, None] * C + cols[None, :], mask=m, other=0)
            if GATHER:
                tl.store(out_q_ptr + rows[:, None] * C + cols[None, :], v, mask=m)
                if tl.program_id(1) == 0:
                    tl.store(out_s_ptr + rows, tl.load(s_ptr + src, mask=rmask, other=0.0), mask=rmask)
            ptrs = t_ptr + cols[:, None].to(tl.int64) * OUT_N + (out0 + rows - start)[None, :]
            tl.store(ptrs, tl.trans(v), mask=cmask[:, None] & (rows < pend)[None, :])
