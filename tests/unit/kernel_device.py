"""Where the Triton kernel cases (`tests/unit/*_kernel_cases.py`) run, picked once per process.

The same case files run two ways: under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by `tests/unit/test_triton_interpreter.py`, which runs them in a fresh process), and on a CUDA GPU with no
interpreter (`benchmarks.gpu_check`). Inputs are always made on the CPU from the same seeded
generators and moved to `DEVICE`; the torch references run on the CPU, so both runs check the
kernels against one reference, bit for bit the same, and results come back to the CPU to be
compared.

On the GPU an fp32 `tl.dot` would default to TF32 (10-bit mantissa inputs), which no fp32
tolerance here allows: TRITON_F32_DEFAULT=ieee is set here if unset (Triton reads it when it
compiles a kernel, and it is part of its cache key), and any other value is refused.
"""

from __future__ import annotations

import os

import torch

from tests.conftest import ulp

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HOW_TO_RUN = ("run a kernel case file either under Triton's interpreter (TRITON_INTERPRET=1 from the start, as "
              "tests/unit/test_triton_interpreter.py does) or on a CUDA GPU: "
              "TRITON_F32_DEFAULT=ieee python -m pytest -q -p no:cacheprovider tests/unit/<name>_kernel_cases.py "
              "(benchmarks.gpu_check runs them all)")


def _pick_device() -> torch.device:
    if INTERPRETED:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device and TRITON_INTERPRET is not 1: {HOW_TO_RUN}")
    precision = os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if precision != "ieee":
        raise RuntimeError(f"TRITON_F32_DEFAULT={precision}: the cases compare fp32 kernels with fp32 torch and need "
                           f"IEEE fp32 tl.dot; {HOW_TO_RUN}")
    return torch.device("cuda", torch.cuda.current_device())  # with its index: equal to a tensor's .device


DEVICE = _pick_device()


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of CPU-made inputs on DEVICE (copies under the interpreter too: a kernel never
    shares memory with a reference's input)."""
    return tuple(t.to(DEVICE, copy=True) for t in tensors)


def same_fp8(got: torch.Tensor, values: torch.Tensor, gpu_rtol: float = 0.0) -> None:
    """fp8 e4m3 `got` (a kernel's output) against the reference `values` (CPU): the fp32 values
    the torch formulation casts to e4m3 (round to nearest even), or that cast itself.

    Under the interpreter, `got` equals the cast except for two defects of the interpreter's fp32
    -> e4m3 cast (the GPU's cvt.rn.satfinite has neither): a value that rounds up to the next
    power of two comes back one binade low (q/2); exact ties round away from zero instead of to
    even, and subnormals (|q| < 2^-6) may round the other way (one fp8 step apart). Both stay
    rare (< 10%); a wrong index, scale or layout changes most values.

    On the GPU, `got` must be the cast of a value within `gpu_rtol` (relative) of `values`: the
    kernel's fp32 arithmetic before the cast may legitimately differ from torch's by that much
    (the caller says why), which moves a value across a rounding boundary only where it lies that
    close to one (an exact tie, such as 448 * 3/64 = 21 between 20 and 22, is one). Everywhere
    else the bytes must be torch's; with gpu_rtol 0, everywhere.
    """
    fp8 = torch.float8_e4m3fn
    g, w = got.cpu().float(), values.to(fp8).float()
    assert g.shape == w.shape
    if INTERPRETED:
        one_step = (g - w).abs() <= ulp(fp8, w.abs().maximum(g.abs()))
        m, _ = torch.frexp(w)  # powers of two have mantissa 0.5
        binade_drop = (m.abs() == 0.5) & (g == w / 2)
        assert bool(((g == w) | binade_drop | one_step).all()), (g - w).abs().max()
        assert (g != w).float().mean() < 0.1  # the exceptions stay exceptions
        return
    v = values.float()
    a, b = (v * (1 - gpu_rtol)).to(fp8).float(), (v * (1 + gpu_rtol)).to(fp8).float()
    ok = (g >= a.minimum(b)) & (g <= a.maximum(b))
    assert bool(ok.all()), f"{int((~ok).sum())} of {g.numel()} fp8 values off; largest gap {(g - w).abs().max()}"
