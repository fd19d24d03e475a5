"""Cases: the Triton fp8 quantisation kernels (`fp8_quant.py`) against their torch formulation.

Not collected on its own: `test_triton_interpreter.py` runs this file under Triton's interpreter on CPU
(fresh process: the interpreter must be on before Triton is first imported), `benchmarks.gpu_check`
on a CUDA GPU (`kernel_device.py`); the torch formulation runs on the CPU.

Under the interpreter scales equal torch's and fp8 values differ only by the interpreter's cast
defects (`kernel_device.same_fp8`). On the GPU the cast is exact, but Triton's fp32 `/` is PTX
div.full.f32, at most 2 ulps from the exact quotient where torch divides as IEEE does: a scale
amax / 448 of the same amax is at most 2 ulps from torch's (SCALE_ULPS), and a value x / scale up
to about 5 ulps (6e-7) from torch's. Triton's sigmoid (ex2.approx, then div.full) puts h = silu(g1)
g3 within about 1.1e-6 of torch's, so a SwiGLU value before the cast is within about 2.5e-6: fp8
values must be the cast of a value within FP8_RTOL of torch's, which lets one cross a rounding
boundary only where it lies that close to one (exact ties such as 21 = 448 * 3/64 are common
with bf16 inputs: 0.6% of one test's values). The SwiGLU scales get 1e-5 (relative) for the same
reason.
"""

import pytest
import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

import titan_ext.models.fp8_quant as fq  # noqa: E402
from tests.conftest import ulp  # noqa: E402
from tests.unit.kernel_device import DEVICE, INTERPRETED, same_fp8  # noqa: E402

BF16_EPS = torch.finfo(torch.bfloat16).eps
SCALE_ULPS = 0 if INTERPRETED else 2
FP8_RTOL = 4e-6


def _torch_path(fn, *args, **kw):
    saved, fq.triton = fq.triton, None
    try:
        return fn(*args, **kw)
    finally:
        fq.triton = saved


def _torch_values(fn, *args, **kw):
    """The torch formulation stopped short of its fp8 cast: the fp32 values it casts, in place of q."""
    saved, fq.FP8 = fq.FP8, torch.float32
    try:
        return _torch_path(fn, *args, **kw)
    finally:
        fq.FP8 = saved


def _cpu(out):
    """A kernel's output (a tensor, or a tuple of tensors and None) back on the CPU."""
    if isinstance(out, torch.Tensor):
        return out.cpu()
    items = [None if t is None else _cpu(t) for t in out]
    return type(out)(*items) if hasattr(out, "_fields") else tuple(items)


def _kernel(fn, *args, **kw):
    """fn's Triton path on copies of the (CPU) inputs on DEVICE, its output back on the CPU."""
    def dev(a):
        if isinstance(a, torch.Tensor):
            return a.to(DEVICE, copy=True)
        return tuple(dev(b) for b in a) if isinstance(a, tuple) else a

    assert fq._use_triton(torch.empty(0, device=DEVICE))
    return _cpu(fn(*map(dev, args), **{k: dev(v) for k, v in kw.items()}))


def _same_fp8(got, values):
    same_fp8(got, values, gpu_rtol=FP8_RTOL)


def _same_scales(got, want):
    """Scales amax / 448 of the same amax (see the module docstring)."""
    assert got.shape == want.shape
    assert bool(((got - want).abs() <= SCALE_ULPS * ulp(torch.float32, want)).all()), (got - want).abs().max()


def _inputs(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3  # rows of unequal range
    return x.to(torch.bfloat16)


def _same_rows(got, values):  # column maxima: maxima of the same values, exact
    _same_scales(got.scale, values.scale)
    assert torch.equal(got.colmax, values.colmax)
    _same_fp8(got.q, values.q)


def test_rows_and_swiglu_rows():
    x = _inputs(48, 100, 0)  # row length not a power of two: masked tail; three 16-row blocks
    got, want = _kernel(fq.quant_rows, x), _torch_values(fq.quant_rows, x)
    assert got.colmax.shape == (3, 100)
    _same_rows(got, want)
    torch.testing.assert_close(got.colmax, x.float().abs().view(3, 16, 100).amax(1), rtol=0, atol=0)
    got, want = _kernel(fq.swiglu_quant_rows, x), _torch_values(fq.swiglu_quant_rows, x)
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
    dg, r, hmax = _kernel(fq.swiglu_bwd_quant_rows, dh, x, colmul, hmul, score)
    dg0, r0, hmax0 = _torch_path(fq.swiglu_bwd_quant_rows, dh, x, colmul, hmul, score)
    # The interpreter's fp32 -> bf16 cast truncates, torch rounds to nearest: one bf16 ulp apart on half
    # the elements; 2 allows for another processor's fp32 rounding (the GPU's: fused multiply-adds, its
    # sigmoid). The scales follow dg's row maxima.
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
    _same_rows(_kernel(fq.quant_rows, x), _torch_values(fq.quant_rows, x))


def test_token_rows_without_column_maxima():
    x = _inputs(21, 2100, 4)  # 21 tokens: any row count (an odd one in a two-row step)
    got, want = _kernel(fq.quant_rows, x, colmax=False), _torch_values(fq.quant_rows, x, colmax=False)
    assert got.colmax is None and want.colmax is None
    _same_scales(got.scale, want.scale)
    _same_fp8(got.q, want.q)


def test_transpose_groups():
    counts = [16, 0, 144, 32, 304]  # empty group, groups across tile and padding boundaries
    starts = fq.padded_starts(counts)
    tok = _kernel(fq.quant_rows, _inputs(70, 100, 2), colmax=False)  # tokens, gathered into routed rows
    src = torch.randint(0, 70, (sum(counts),), generator=torch.Generator().manual_seed(6))
    own = _kernel(fq.quant_rows, _inputs(sum(counts), 100, 3))  # rows in place
    for rows, s in ((tok, src), (own, None)):
        got = _kernel(fq.transpose_groups, rows.q, counts, s, rows.scale)
        want = _torch_path(fq.transpose_groups, rows.q, counts, s, rows.scale)
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
        colmax = _kernel(fq.swiglu_bwd_quant_rows, dh, x, torch.ones(sum(counts)), m)[2]
    else:
        colmax = fq._colmax(x.float().abs(), m)
    q, s = _kernel(fq.quant_cols_t, x, counts, colmax, mul_R=m, swiglu=swiglu)
    q0, s0 = _torch_cols(x, counts, colmax, mul_R=m, swiglu=swiglu)
    starts = fq.padded_starts(counts)
    assert q.shape == (70, starts[-1]) and all(p % fq.COL_ALIGN == 0 for p in starts)
    _same_scales(s, s0)
    v = fq._values(x, m, swiglu)
    torch.testing.assert_close(s[2], v[16:160].abs().amax(0) / 448, rtol=1e-5, atol=0)  # the group's own maximum
    _same_fp8(q, q0)  # padding columns included: zeros in both


def _torch_cols(*args, **kw):
    return _torch_values(fq.quant_cols_t, *args, **kw)


def test_cols_stacked_weights():
    w = _inputs(3 * 48, 40, 3)
    colmax = _kernel(fq.quant_rows, w).colmax
    q, s = _kernel(fq.quant_cols_t, w, [48] * 3, colmax, stacked=True)
    q0, s0 = _torch_cols(w, [48] * 3, colmax, stacked=True)
    assert q.shape == (3, 40, 48)
    _same_scales(s, s0)
    _same_fp8(q, q0)


def test_interleaved_weights():
    """W1 and W3 [E*F, D] read as one [E, 2F, D] weight: the same as quantising their concatenation."""
    e, f, d = 3, 64, 2100
    w1, w3 = _inputs(e * f, d, 12), _inputs(e * f, d, 13)
    cat = torch.cat([w1.view(e, f, d), w3.view(e, f, d)], dim=1).reshape(e * 2 * f, d)
    rows = _kernel(fq.quant_rows, w1, interleave=(w3, f))
    _same_rows(rows, _torch_values(fq.quant_rows, cat))
    q, s = _kernel(fq.quant_cols_t, w1, [2 * f] * e, rows.colmax, stacked=True, interleave=(w3, f))
    q0, s0 = _torch_cols(cat, [2 * f] * e, rows.colmax, stacked=True)
    assert q.shape == (e, d, 2 * f)
    _same_scales(s, s0)
    _same_fp8(q, q0)
