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
    one_step = (g - w).abs() <= torch.maximum(w.abs().maximum(g.abs()) / 8, torch.tensor(2.0**-9))
    assert bool(((g == w) | binade_drop | one_step).all()), (g - w).abs().max()
    assert (g != w).float().mean() < 0.1  # the exceptions stay exceptions


def _inputs(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3  # rows of unequal range
    return x.to(torch.bfloat16)


def _same_rows(got, want, scale_rtol=1e-5):
    torch.testing.assert_close(got.scale, want.scale, rtol=scale_rtol, atol=0)
    torch.testing.assert_close(got.colmax, want.colmax, rtol=scale_rtol, atol=0)
    _same_fp8(got.q, want.q)


def test_rows_and_swiglu_rows():
    x = _inputs(48, 100, 0)  # row length not a power of two: masked tail; three 16-row blocks
    for fn in (fq.quant_rows, fq.swiglu_quant_rows):
        got, want = fn(x), _torch_path(fn, x)
        assert got.colmax.shape == (3, want.q.size(1))
        _same_rows(got, want)  # Triton's sigmoid vs torch's silu: scales within 1e-5
    dh = _inputs(48, 50, 1)
    dg, r = fq.swiglu_bwd_quant_rows(dh, x)
    dg0, r0 = _torch_path(fq.swiglu_bwd_quant_rows, dh, x)
    assert (dg.float() - dg0.float()).abs().max() <= 2 ** -7 * dg0.float().abs().max()  # bf16 rounding apart
    torch.testing.assert_close(r.scale, r0.scale, rtol=1e-2, atol=0)
    torch.testing.assert_close(r.colmax, dg.float().abs().view(3, 16, 100).amax(1), rtol=0, atol=0)
    # q * scale is dg to fp8 precision (a row's scale can differ by dg's bf16 rounding, so q may not match q0)
    assert (r.q.float() * r.scale[:, None] - dg.float()).norm() < 0.08 * dg.float().norm()


def test_rows_wider_than_2048_two_per_step():
    x = _inputs(32, 2100, 9)  # rows over 2048 wide: two rows per step (masked tail)
    g = torch.Generator().manual_seed(10)
    src = torch.randint(0, 32, (48,), generator=g)
    mul = torch.rand(48, generator=g)
    assert fq._rows_per_step(2100, dot=False) == 2
    for args in ((x,), (x, src, mul)):
        _same_rows(fq.quant_rows(*args), _torch_path(fq.quant_rows, *args))


def test_rows_gathered_scaled_with_dot():
    x = _inputs(20, 100, 4)  # tokens
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, 20, (64,), generator=g)
    mul = torch.rand(64, generator=g).to(torch.bfloat16)
    mul[7] = 0  # a pad row
    y = _inputs(64, 100, 6)
    got = fq.quant_rows(x, src, mul, dot_with_RC=y)
    want = _torch_path(fq.quant_rows, x, src, mul, dot_with_RC=y)
    _same_rows(got, want)
    torch.testing.assert_close(got.dot, want.dot, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.q[7].float(), torch.zeros(100))
    # the rows are x[src] * mul: same scales as quantising the materialised rows
    torch.testing.assert_close(got.scale, _torch_path(fq.quant_rows, x[src].float() * mul.float()[:, None]).scale)


@pytest.mark.parametrize("swiglu", [False, True])
def test_cols_transposed_grouped(swiglu):
    counts = [16, 0, 144, 32, 304]  # empty group, groups across tile and padding boundaries
    x = _inputs(sum(counts), 70 * (2 if swiglu else 1), 2)
    rows = (fq.swiglu_quant_rows if swiglu else fq.quant_rows)(x)
    (q, s), (q0, s0) = (f(x, counts, rows.colmax, swiglu=swiglu) for f in (fq.quant_cols_t, _torch_cols))
    starts = fq.padded_starts(counts)
    assert q.shape == (70, starts[-1]) and all(p % fq.COL_ALIGN == 0 for p in starts)
    torch.testing.assert_close(s, s0, rtol=1e-6, atol=0)
    v = fq._values(x, swiglu=swiglu)
    torch.testing.assert_close(s[2], v[16:160].abs().amax(0) / 448, rtol=1e-5, atol=0)  # the group's own maximum
    _same_fp8(q, q0)  # padding columns included: zeros in both


def test_cols_gathered_scaled():
    x = _inputs(30, 70, 7)
    counts = [48, 0, 16]
    g = torch.Generator().manual_seed(8)
    src = torch.randint(0, 30, (64,), generator=g)
    mul = torch.rand(64, generator=g)
    rows = fq.quant_rows(x, src, mul)
    (q, s), (q0, s0) = (f(x, counts, rows.colmax, src_R=src, mul_R=mul) for f in (fq.quant_cols_t, _torch_cols))
    torch.testing.assert_close(s, s0, rtol=1e-6, atol=0)
    _same_fp8(q, q0)
    v = x[src].float() * mul[:, None]  # the same as quantising the gathered, scaled rows
    (q1, s1) = _torch_cols(v, counts, _torch_path(fq.quant_rows, v).colmax)
    torch.testing.assert_close(s, s1, rtol=1e-6, atol=0)
    _same_fp8(q, q1)


def _torch_cols(*args, **kw):
    return _torch_path(fq.quant_cols_t, *args, **kw)


def test_cols_stacked_weights():
    w = _inputs(3 * 48, 40, 3)
    colmax = fq.quant_rows(w).colmax
    (q, s), (q0, s0) = (f(w, [48] * 3, colmax, stacked=True) for f in (fq.quant_cols_t, _torch_cols))
    assert q.shape == (3, 40, 48)
    assert torch.equal(s, s0)
    _same_fp8(q, q0)
