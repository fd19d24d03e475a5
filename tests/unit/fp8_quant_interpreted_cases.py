"""Cases: the Triton fp8 quantisation kernels (`fp8_quant.py`) against their torch formulation.

Not collected on its own: `test_fp8_experts.py` runs this file in a fresh process with
TRITON_INTERPRET=1 (the interpreter must be on before Triton is first imported). Scales must
match; fp8 values must match except for two defects of the interpreter's fp32 -> e4m3 cast
(the GPU's cvt.rn.satfinite has none): a value that rounds up to the next power of two
comes back one binade low (q/2); exact ties round away from zero instead of to even, and
subnormals (|q| < 2^-6) may round the other way (one fp8 step apart). Both stay rare; a wrong index, scale or layout changes most values.
"""

import os

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run through tests/unit/test_fp8_experts.py (needs TRITON_INTERPRET=1 from the start)")

import pytest  # noqa: E402

import titan_ext.models.fp8_quant as fq  # noqa: E402
from tests.conftest import ulp  # noqa: E402

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _torch_path(fn, *args, **kw):
    saved, fq.triton = fq.triton, None
    try:
        return fn(*args, **kw)
    finally:
        fq.triton = saved


def _same_fp8(got, want):
    g, w = got.float(), want.float()
    assert g.shape == w.shape
    m, _ = torch.frexp(w)  # powers of two have mantissa 0.5
    binade_drop = (m.abs() == 0.5) & (g == w / 2)
    one_step = (g - w).abs() <= ulp(fq.FP8, w.abs().maximum(g.abs()))
    assert bool(((g == w) | binade_drop | one_step).all()), (g - w).abs().max()
    assert (g != w).float().mean() < 0.1  # the exceptions stay exceptions


def _inputs(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3  # rows of unequal range
    return x.to(torch.bfloat16)


def _same_rows(got, want, scale_rtol=1e-5):  # scales and column maxima are fp32, computed alike
    torch.testing.assert_close(got.scale, want.scale, rtol=scale_rtol, atol=0)
    torch.testing.assert_close(got.colmax, want.colmax, rtol=scale_rtol, atol=0)
    _same_fp8(got.q, want.q)


def test_rows_and_swiglu_rows():
    x = _inputs(48, 100, 0)  # row length not a power of two: masked tail; three 16-row blocks
    got, want = fq.quant_rows(x), _torch_path(fq.quant_rows, x)
    assert got.colmax.shape == (3, 100)
    _same_rows(got, want)
    torch.testing.assert_close(got.colmax, x.float().abs().view(3, 16, 100).amax(1), rtol=0, atol=0)
    got, want = fq.swiglu_quant_rows(x), _torch_path(fq.swiglu_quant_rows, x)
    assert got.colmax is None and got.q.shape == (48, 50)
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=0)  # Triton's sigmoid vs torch's silu
    _same_fp8(got.q, want.q)


@pytest.mark.parametrize("with_score", [False, True])
def test_swiglu_bwd_rows(with_score):
    x, dh = _inputs(48, 100, 0), _inputs(48, 50, 1)
    g = torch.Generator().manual_seed(12)
    colmul, hmul = torch.rand(48, generator=g), torch.rand(48, generator=g)
    score = torch.rand(48, generator=g).to(torch.bfloat16) if with_score else None
    score_f = score.float()[:, None] if with_score else 1.0
    dg, r, hmax = fq.swiglu_bwd_quant_rows(dh, x, colmul, hmul, score)
    dg0, r0, hmax0 = _torch_path(fq.swiglu_bwd_quant_rows, dh, x, colmul, hmul, score)
    # The interpreter's fp32 -> bf16 cast truncates, torch rounds to nearest: one bf16 ulp apart on half
    # the elements; 2 allows for another processor's fp32 rounding. The scales follow dg's row maxima.
    a, b = dg.float(), dg0.float()
    assert bool(((a - b).abs() <= 2 * ulp(torch.bfloat16, a.abs().maximum(b.abs()))).all())
    torch.testing.assert_close(r.scale, r0.scale, rtol=2 * BF16_EPS, atol=0)
    torch.testing.assert_close(r.colmax, (dg.float().abs() * colmul[:, None]).view(3, 16, 100).amax(1), rtol=0, atol=0)
    # q * scale is dg to fp8 precision: rounding to nearest is within half an e4m3 ulp of each element
    # (a row's scale can differ by dg's bf16 rounding, so q may not match q0)
    fp8_eps = torch.finfo(fq.FP8).eps
    assert (r.q.float() * r.scale[:, None] - dg.float()).norm() < fp8_eps / 2 * dg.float().norm()
    # dg = the autograd gradient of h = silu(g1) g3 for output gradient score * dh, elementwise: to a bf16 ulp
    # (the truncating cast), 2 for another processor's fp32 rounding
    g13 = x.float().requires_grad_(True)
    h = fq._swiglu(g13)
    h.backward(dh.float() * score_f)
    assert bool(((dg.float() - g13.grad).abs() <= 2 * ulp(torch.bfloat16, g13.grad)).all())
    h = h.detach()
    torch.testing.assert_close(hmax, (h.abs() * hmul[:, None]).view(3, 16, 50).amax(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(hmax, hmax0, rtol=1e-5, atol=0)
    if with_score:  # the score gradient <dh, h>: fp32 sums, in another order
        torch.testing.assert_close(r.dot, (dh.float() * h).sum(1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r.dot, r0.dot, rtol=1e-4, atol=1e-4)
    else:
        assert r.dot is None


def test_rows_wider_than_2048_two_per_step():
    x = _inputs(32, 2100, 9)  # rows over 2048 wide: two rows per step (masked tail)
    assert fq._rows_per_step(2100) == 2
    _same_rows(fq.quant_rows(x), _torch_path(fq.quant_rows, x))


def test_token_rows_without_column_maxima():
    x = _inputs(21, 2100, 4)  # 21 tokens: any row count (an odd one in a two-row step)
    got, want = fq.quant_rows(x, colmax=False), _torch_path(fq.quant_rows, x, colmax=False)
    assert got.colmax is None and want.colmax is None
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=0)
    _same_fp8(got.q, want.q)


def test_transpose_groups():
    counts = [16, 0, 144, 32, 304]  # empty group, groups across tile and padding boundaries
    starts = fq.padded_starts(counts)
    tok = fq.quant_rows(_inputs(70, 100, 2), colmax=False)  # tokens, gathered into routed rows
    src = torch.randint(0, 70, (sum(counts),), generator=torch.Generator().manual_seed(6))
    own = fq.quant_rows(_inputs(sum(counts), 100, 3))  # rows in place
    for rows, s in ((tok, src), (own, None)):
        got, want = fq.transpose_groups(rows.q, counts, s, rows.scale), _torch_path(
            fq.transpose_groups, rows.q, counts, s, rows.scale)
        assert got.t.shape == (100, starts[-1])
        assert torch.equal(got.t.view(torch.uint8), want.t.view(torch.uint8))  # moved bytes: exact
        v = rows.q.float() if s is None else rows.q.float()[s]
        assert torch.equal(got.q.float(), v) and torch.equal(got.scale, rows.scale if s is None else rows.scale[s])
        assert torch.equal(got.t.float()[:, starts[2]:starts[2] + 144], v[16:160].t())
        assert torch.count_nonzero(got.t.float()[:, starts[2] + 144:starts[3]]) == 0  # the padding


@pytest.mark.parametrize("mul,swiglu", [(False, False), (True, False), (True, True)])
def test_cols_transposed_grouped(mul, swiglu):
    counts = [16, 0, 144, 32, 304]  # empty group, groups across tile and padding boundaries
    x = _inputs(sum(counts), 70 * (2 if swiglu else 1), 2)
    g = torch.Generator().manual_seed(7)
    m = torch.rand(sum(counts), generator=g) if mul else None
    if swiglu:  # h's column maxima come from the SwiGLU backward's row pass (kernel), as in the block
        dh = _inputs(sum(counts), 70, 8)
        colmax = fq.swiglu_bwd_quant_rows(dh, x, torch.ones(sum(counts)), m)[2]
    else:
        colmax = fq._colmax(x.float().abs(), m)
    (q, s), (q0, s0) = (f(x, counts, colmax, mul_R=m, swiglu=swiglu) for f in (fq.quant_cols_t, _torch_cols))
    starts = fq.padded_starts(counts)
    assert q.shape == (70, starts[-1]) and all(p % fq.COL_ALIGN == 0 for p in starts)
    torch.testing.assert_close(s, s0, rtol=1e-6, atol=0)
    v = fq._values(x, m, swiglu)
    torch.testing.assert_close(s[2], v[16:160].abs().amax(0) / 448, rtol=1e-5, atol=0)  # the group's own maximum
    _same_fp8(q, q0)  # padding columns included: zeros in both


def _torch_cols(*args, **kw):
    return _torch_path(fq.quant_cols_t, *args, **kw)


def test_cols_stacked_weights():
    w = _inputs(3 * 48, 40, 3)
    colmax = fq.quant_rows(w).colmax
    (q, s), (q0, s0) = (f(w, [48] * 3, colmax, stacked=True) for f in (fq.quant_cols_t, _torch_cols))
    assert q.shape == (3, 40, 48)
    assert torch.equal(s, s0)
    _same_fp8(q, q0)


def test_interleaved_weights():
    """W1 and W3 [E*F, D] read as one [E, 2F, D] weight: the same as quantising their concatenation."""
    e, f, d = 3, 64, 2100
    w1, w3 = _inputs(e * f, d, 12), _inputs(e * f, d, 13)
    cat = torch.cat([w1.view(e, f, d), w3.view(e, f, d)], dim=1).reshape(e * 2 * f, d)
    rows = fq.quant_rows(w1, interleave=(w3, f))
    _same_rows(rows, _torch_path(fq.quant_rows, cat))
    (q, s), (q0, s0) = (fn(*args, [2 * f] * e, rows.colmax, stacked=True, **kw) for fn, args, kw in (
        (fq.quant_cols_t, (w1,), {"interleave": (w3, f)}), (_torch_cols, (cat,), {})))
    assert q.shape == (e, d, 2 * f)
    torch.testing.assert_close(s, s0, rtol=1e-6, atol=0)
    _same_fp8(q, q0)
