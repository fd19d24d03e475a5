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
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from .matmul import bmm_fp32


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


# ---------------------------------------------------------------------------
# Lean local token permutation (EP=1 path of the dispatcher).
#
# TorchTitan 0.3.0's local dispatch gathers the routed rows with autograd's
# generic indexing (backward: a sorting index_put with accumulate), and its
# combine casts the whole [rows, dim] expert output to fp32, multiplies by the
# scores, casts back and scatter-adds with deterministic algorithms forced on:
# about 14 passes over a [rows, dim] tensor forward, as many backward. Here both
# directions are gathers with known duals:
#   dispatch  routed[r] = x[src[r]]             grad_x[t] = sum_k grad_routed[slot[t, k]]
#   combine   out[t] = sum_k s[t,k] y[slot[t,k]]  grad_y[r] = s_r grad_out[src[r]],
#                                                 grad_s[t,k] = <grad_out[t], y[slot[t,k]]>
# No atomics, deterministic, and exact in fp32 (CPU parity is unchanged).
# With `pad_multiple` > 1 each expert's group is padded to a multiple of it (what
# fp8 grouped GEMMs need); pad rows repeat a real token and get score 0, so they
# carry zero gradient, and the row count stays static (T*K + E*(pad-1)).
# ---------------------------------------------------------------------------


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, src_R: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_TK)
        return x_TD.index_select(0, src_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (slot_TK,) = ctx.saved_tensors
        t, k = slot_TK.shape
        grad_TKD = grad_RD.index_select(0, slot_TK.reshape(-1)).view(t, k, grad_RD.size(-1))
        return grad_TKD.sum(dim=1), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, scores_TK: torch.Tensor, src_R: torch.Tensor,
                slot_TK: torch.Tensor, score_R: torch.Tensor) -> torch.Tensor:
        t, k = slot_TK.shape
        y_TKD = y_RD.index_select(0, slot_TK.reshape(-1)).view(t, k, y_RD.size(-1))
        out_T1D = torch.bmm(scores_TK.to(y_RD.dtype).unsqueeze(1), y_TKD)
        ctx.save_for_backward(y_RD, src_R, slot_TK, score_R)
        ctx.scores_dtype = scores_TK.dtype
        return out_T1D.squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, src_R, slot_TK, score_R = ctx.saved_tensors
        g_RD = grad_TD.index_select(0, src_R)
        g_R1D, y_RD1 = g_RD.unsqueeze(1), y_RD.unsqueeze(2)
        grad_s_R = bmm_fp32(g_R1D, y_RD1).view(-1)  # fp32, as TorchTitan's fp32 score product gives
        grad_scores_TK = grad_s_R.index_select(0, slot_TK.reshape(-1)).view(slot_TK.shape).to(ctx.scores_dtype)
        grad_y_RD = g_RD.mul_(score_R.to(g_RD.dtype).unsqueeze(1))
        return grad_y_RD, grad_scores_TK, None, None, None


@dataclass(frozen=True, kw_only=True)
class LeanDispatchMetadata:
    src_R: torch.Tensor  # token of each routed row (pad rows: any real token)
    slot_TK: torch.Tensor  # routed row of each (token, k) choice
    score_R: torch.Tensor  # routing score of each routed row (pad rows: 0)
    scores_TK: torch.Tensor


def lean_permutation(topk_expert_ids_TK: torch.Tensor, topk_scores_TK: torch.Tensor,
                     num_tokens_per_expert_E: torch.Tensor, pad_multiple: int = 1):
    """Routing tensors of the lean dispatch: (src_R, slot_TK, score_R, tokens per expert as laid out)."""
    t, k = topk_expert_ids_TK.shape
    n = t * k
    e = num_tokens_per_expert_E.numel()
    device = topk_expert_ids_TK.device
    ids_N = topk_expert_ids_TK.reshape(-1)
    order_N = torch.argsort(ids_N, stable=True)
    dest_N = torch.arange(n, device=device)
    counts_E = num_tokens_per_expert_E.to(torch.int64)
    rows = n
    if pad_multiple > 1:
        padded_E = (counts_E + pad_multiple - 1) // pad_multiple * pad_multiple
        shift_E = (torch.cumsum(padded_E, 0) - padded_E) - (torch.cumsum(counts_E, 0) - counts_E)
        dest_N = dest_N + shift_E.index_select(0, ids_N.index_select(0, order_N))
        counts_E = padded_E
        rows = n + e * (pad_multiple - 1)
    slot_N = torch.empty(n, dtype=torch.int64, device=device).index_copy_(0, order_N, dest_N)
    src_R = torch.zeros(rows, dtype=torch.int64, device=device).index_copy_(0, dest_N, order_N // k)
    score_R = torch.zeros(rows, dtype=topk_scores_TK.dtype, device=device).index_copy_(
        0, dest_N, topk_scores_TK.detach().reshape(-1).index_select(0, order_N))
    return src_R, slot_N.view(t, k), score_R, counts_E


class LeanTokenDispatcher(AllToAllTokenDispatcher):
    """TorchTitan's standard dispatcher with a lean permutation when expert parallel is off.

    With an EP mesh it is exactly `AllToAllTokenDispatcher`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pad_multiple: int = 1

    def __init__(self, config: Config):
        super().__init__(config)
        self.pad_multiple = config.pad_multiple

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if self.ep_mesh is not None:
            return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        src_R, slot_TK, score_R, counts_E = lean_permutation(
            topk_expert_ids_TK, topk_scores_TK, num_local_tokens_per_expert_E, self.pad_multiple)
        routed_RD = _DispatchRows.apply(x_TD, src_R, slot_TK)
        meta = LeanDispatchMetadata(src_R=src_R, slot_TK=slot_TK, score_R=score_R, scores_TK=topk_scores_TK)
        return routed_RD, counts_E, meta

    def combine(self, routed_output_RD, metadata, x_TD):
        if not isinstance(metadata, LeanDispatchMetadata):
            return super().combine(routed_output_RD, metadata, x_TD)
        out_TD = _CombineRows.apply(routed_output_RD, metadata.scores_TK, metadata.src_R,
                                    metadata.slot_TK, metadata.score_R)
        return out_TD.to(x_TD.dtype)
