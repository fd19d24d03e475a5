"""Routed experts that compute in the dtype they are given.

TorchTitan 0.3.0's `GroupedExperts` casts activations and weights to bf16 before
`torch._grouped_mm` (the CUDA kernel once required it). That makes an fp32 model
disagree with its transformers reference by bf16 rounding, so a port can never be
checked to 1e-4. Under FSDP mixed precision the inputs already arrive in bf16, so
keeping the input dtype costs nothing on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class NativeDtypeGroupedExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dtype = x_RD.dtype
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offs)
