"""Cases: the lean dispatcher's Triton kernels (`experts.py`: the gather-sum of dispatch backward
and combine forward, the combine backward) pass the lean-vs-TorchTitan parity test of
`test_gpu_paths.py`, which runs on CPU with the torch formulations.

Not collected on its own: `test_triton_interpreter.py` runs this file under Triton's interpreter on CPU
(fresh process), `benchmarks.gpu_check` on a CUDA GPU (`kernel_device.py`). TorchTitan's dispatch
(the reference) runs on the CPU, the lean block on DEVICE, in fp32: on the GPU its expert matmuls
are cuBLAS fp32 (no TF32 by default) and the kernels accumulate in fp32, so the parity test's 1e-5
relative bounds stand.
"""

import pytest
import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from tests.unit.kernel_device import DEVICE, INTERPRETED  # noqa: E402
from tests.unit.test_gpu_paths import lean_matches_stock  # noqa: E402
from titan_ext.models import experts  # noqa: E402


@pytest.mark.parametrize("model,pad", [("kimi_k2", 1), ("glm5", 1), ("kimi_k2", 16)])
def test_lean_dispatch_kernels_match_torchtitan_dispatch(model, pad, monkeypatch):
    chosen = []
    use_triton = experts._use_triton

    def record(t):
        # The kernels run for CUDA tensors only; under the interpreter they run on CPU ones. On the
        # GPU the reference block's CPU tensors ask too (and are told no): only the lean block's count.
        if INTERPRETED:
            chosen.append(True)
            return True
        use = use_triton(t)
        if t.device.type == DEVICE.type:
            chosen.append(use)
        return use

    monkeypatch.setattr(experts, "_use_triton", record)
    if DEVICE.type == "cuda":
        assert torch.get_float32_matmul_precision() == "highest", "fp32 matmuls in TF32 would miss the 1e-5 bounds"
    lean_matches_stock(model, pad, DEVICE)
    assert len(chosen) >= 3 and all(chosen)  # combine forward and backward, dispatch backward: the kernels ran
