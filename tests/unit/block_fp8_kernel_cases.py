"""Cases: the Triton block-fp8 quantizer (`block_fp8_triton.py`) against the torch one.

Not collected on its own: `test_triton_interpreter.py` runs this file under Triton's interpreter on CPU
(fresh process), `benchmarks.gpu_check` on a CUDA GPU (`kernel_device.py`); the torch quantizer
runs on the CPU. Scales must be equal bit for bit (both divide with IEEE rounding: `div_rn` in the
kernel). fp8 values too on the GPU (round-to-nearest-even, saturated, as torch); under the
interpreter up to its fp32 -> e4m3 cast defects (`kernel_device.same_fp8`).
"""

import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from tests.unit.kernel_device import on_device, same_fp8  # noqa: E402
from titan_ext.models.block_fp8 import quantize_torch  # noqa: E402
from titan_ext.models.block_fp8_triton import quantize_cuda  # noqa: E402


def _kernel(w, block=(128, 128)):
    q, s = quantize_cuda(*on_device(w), block)
    return q.cpu(), s.cpu()


def _check(w, block=(128, 128)):
    q, s = _kernel(w, block)
    want_q, want_s = quantize_torch(w, block)
    assert q.shape == want_q.shape and s.shape == want_s.shape
    assert torch.equal(s, want_s)
    same_fp8(q, want_q)
    return q, s


def test_cut_edge_blocks_zero_block_and_fp32_input():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(576, 200, generator=g) * torch.rand(576, 1, generator=g) * 0.1).to(torch.bfloat16)
    w[128:256, :128] = 0
    q, s = _check(w)
    assert (q[128:256, :128].float() == 0).all() and s[1, 0] == 1e-4 / 448
    _check(w.float() * 3)
    _check(w, block=(64, 32))


def test_stacked_experts_and_non_finite_weights():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 130, 256, generator=g) * 0.05).to(torch.bfloat16)
    _, s = _check(w)
    assert s.shape == (3, 2, 2)
    w[2, 129, 255] = float("nan")
    w[0, 0, 0] = float("inf")
    _, s = _kernel(w)
    assert torch.isinf(s[2, 1, 1]) and torch.isinf(s[0, 0, 0]) and torch.isfinite(s[1]).all()
