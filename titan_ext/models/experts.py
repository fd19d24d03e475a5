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

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch builds): the torch formulations serve every device
    triton = None


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
# On CUDA the three passes that touch [rows, dim] tensors besides the dispatch gather
# (combine forward, combine backward, dispatch backward) are one Triton kernel each,
# reading every routed row once. Profiled on an H200 (Kimi-K2 block, 48 local experts,
# 64k tokens, fwd+bwd 307 ms): the torch formulation spent about 50 ms in these passes
# (gathers materialising [T, K, D], the combine as a batched M=1 bmm that cuBLAS runs
# as gemv, separate scaling passes); the kernels take 9 ms, near HBM bandwidth, and the
# block 280 ms.
# With `pad_multiple` > 1 each expert's group is padded to a multiple of it (what
# fp8 grouped GEMMs need); pad rows repeat a real token and get score 0, so they
# carry zero gradient, and the row count stays static (T*K + E*(pad-1)).
# ---------------------------------------------------------------------------


def _use_triton(t: torch.Tensor) -> bool:
    # Under torch.compile the torch formulation is used: Inductor fuses it into one kernel.
    return triton is not None and t.is_cuda and not torch.compiler.is_compiling()


def gather_sum(rows_RD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * rows[slot[t, k]] (w = 1 when None), accumulated in fp32.

    On CUDA one Triton pass reads the K rows of each token and writes its sum; the torch
    formulation (CPU, torch.compile) materialises the [T, K, D] gather first.
    """
    t, k = slot_TK.shape
    d = rows_RD.size(-1)
    if _use_triton(rows_RD):
        rows_RD, slot_TK = rows_RD.contiguous(), slot_TK.contiguous()
        out_TD = torch.empty(t, d, dtype=rows_RD.dtype, device=rows_RD.device)
        w = slot_TK if w_TK is None else w_TK.contiguous()
        _gather_sum_kernel[(t, triton.cdiv(d, _BLOCK_D))](
            rows_RD, slot_TK, w, out_TD, d, K=k, HAS_W=w_TK is not None, BLOCK_D=_BLOCK_D)
        return out_TD
    rows_TKD = rows_RD.index_select(0, slot_TK.reshape(-1)).view(t, k, d)
    if w_TK is None:
        return rows_TKD.sum(dim=1)
    return (rows_TKD.float() * w_TK.float().unsqueeze(-1)).sum(dim=1).to(rows_RD.dtype)


def combine_grads(grad_TD: torch.Tensor, y_RD: torch.Tensor, src_R: torch.Tensor, score_R: torch.Tensor,
                  slot_TK: torch.Tensor, scores_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of out[t] = sum_k s[t, k] y[slot[t, k]]: (grad_y, grad_s), grad_s in fp32.

    grad_y[slot[t, k]] = s[t, k] g[t] (0 on pad rows), grad_s[t, k] = <g[t], y[slot[t, k]]>.
    On CUDA one Triton pass per token reads g[t] once and its K expert rows; the torch
    formulation (CPU, torch.compile) gathers g per routed row first (src, score_R).
    """
    if _use_triton(y_RD):
        grad_TD, y_RD, slot_TK = grad_TD.contiguous(), y_RD.contiguous(), slot_TK.contiguous()
        t, k = slot_TK.shape
        r, d = y_RD.shape
        grad_y_RD = torch.empty_like(y_RD) if r == t * k else torch.zeros_like(y_RD)  # pad rows get no gradient
        grad_s_TK = torch.empty(t, k, dtype=torch.float32, device=y_RD.device)
        _combine_bwd_kernel[(t,)](grad_TD, y_RD, slot_TK, scores_TK.detach().contiguous(), grad_y_RD, grad_s_TK, d,
                                  K=k, K_PAD=triton.next_power_of_2(k), BLOCK_D=_BLOCK_D // 2, num_warps=8)
        return grad_y_RD, grad_s_TK
    g_RD = grad_TD.index_select(0, src_R).float()
    grad_s_R = (g_RD * y_RD.float()).sum(dim=-1)
    grad_y_RD = (g_RD * score_R.float().unsqueeze(1)).to(y_RD.dtype)
    return grad_y_RD, grad_s_R.index_select(0, slot_TK.reshape(-1)).view(slot_TK.shape)


_BLOCK_D = 1024

if triton is not None:

    @triton.jit
    def _gather_sum_kernel(rows_ptr, slot_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            r = tl.load(slot_ptr + t * K + k).to(tl.int64)
            v = tl.load(rows_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * K + k).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(g_ptr, y_ptr, slot_ptr, w_ptr, gy_ptr, gw_ptr, D, K: tl.constexpr, K_PAD: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, K_PAD)
        kmask = ks < K
        r = tl.load(slot_ptr + t * K + ks, mask=kmask, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
        acc = tl.zeros([K_PAD, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            dmask = offs < D
            g = tl.load(g_ptr + t * D + offs, mask=dmask, other=0.0).to(tl.float32)
            m2 = kmask[:, None] & dmask[None, :]
            rows = r[:, None] * D + offs[None, :]
            y = tl.load(y_ptr + rows, mask=m2, other=0.0).to(tl.float32)
            acc += y * g[None, :]
            tl.store(gy_ptr + rows, (w[:, None] * g[None, :]).to(gy_ptr.dtype.element_ty), mask=m2)
        tl.store(gw_ptr + t * K + ks, tl.sum(acc, axis=1), mask=kmask)


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, src_R: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_TK)
        return x_TD.index_select(0, src_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (slot_TK,) = ctx.saved_tensors
        return gather_sum(grad_RD, slot_TK), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, scores_TK: torch.Tensor, src_R: torch.Tensor,
                slot_TK: torch.Tensor, score_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_RD, src_R, slot_TK, score_R, scores_TK)
        return gather_sum(y_RD, slot_TK, scores_TK)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, src_R, slot_TK, score_R, scores_TK = ctx.saved_tensors
        grad_y_RD, grad_s_TK = combine_grads(grad_TD, y_RD, src_R, score_R, slot_TK, scores_TK)
        return grad_y_RD, grad_s_TK.to(scores_TK.dtype), None, None, None


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
