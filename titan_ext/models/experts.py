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
import torch.distributed as dist
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
# Lean token permutation (the lean dispatcher's layouts, at every EP degree).
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


class _GatherRows(torch.autograd.Function):
    """out[r] = rows[idx[r]]; backward grad_rows[n] = sum_k w[n, k] grad_out[dual[n, k]] (w = 1 when None).

    `dual` lists, for every input row, the output rows that copied it; with `w` 0 on pad
    rows that copied nothing real. The backward is a gather, not a sorting scatter.
    """

    @staticmethod
    def forward(ctx, rows_ND: torch.Tensor, idx_R: torch.Tensor, dual_NK: torch.Tensor,
                dual_w_NK: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(dual_NK, dual_w_NK)
        return rows_ND.index_select(0, idx_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        dual_NK, dual_w_NK = ctx.saved_tensors
        return gather_sum(grad_RD, dual_NK, dual_w_NK), None, None, None


class _CombineRows(torch.autograd.Function):
    """out[n] = sum_k weights[n, k] y[slot[n, k]]; weights None: a plain sum (the scores were applied
    where the rows were computed; score_R then only masks pad rows, None when there are none)."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, weights_NK: torch.Tensor | None, src_R: torch.Tensor,
                slot_NK: torch.Tensor, score_R: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(y_RD, src_R, slot_NK, score_R, weights_NK)
        return gather_sum(y_RD, slot_NK, weights_NK)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        y_RD, src_R, slot_NK, score_R, weights_NK = ctx.saved_tensors
        if weights_NK is None:  # grad_y[r] = grad[src[r]] (0 on pad rows, whose score_R is 0)
            mask_R1 = None if score_R is None else score_R[:, None]
            return gather_sum(grad_ND, src_R[:, None], mask_R1), None, None, None, None
        grad_y_RD, grad_s_NK = combine_grads(grad_ND, y_RD, src_R, score_R, slot_NK, weights_NK)
        return grad_y_RD, grad_s_NK.to(weights_NK.dtype), None, None, None


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with known split sizes; the backward sends the gradient back the same way.

    A plain c10d collective (works on gloo and NCCL, torch 2.11 and 2.13); the output is
    ready for Triton kernels, unlike a functional collective's lazy AsyncCollectiveTensor.
    """

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_ND.new_empty(sum(out_splits), x_ND.size(1))
        dist.all_to_all_single(out, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(in_splits), grad_out.size(1))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


@dataclass(frozen=True, kw_only=True)
class ExpertRoute:
    """How this rank's expert rows are laid out over the rows it holds after the exchange.

    Expert row r (expert-major, each expert's group padded to the dispatcher's multiple) is
    held row src[r]; held row n's expert rows are slot[n, :]. The output of held row n is
    sum_k weights[n, k] y[slot[n, k]].
    """

    src_R: torch.Tensor  # held row of each expert row (pad rows: any real row)
    slot_NK: torch.Tensor  # expert rows of each held row
    score_R: torch.Tensor  # weight of each expert row (pad rows: 0)
    weights_NK: torch.Tensor  # routing scores of the held rows' expert rows (0 where masked)
    counts_E: torch.Tensor  # rows per local expert as laid out (device)
    counts: list[int] | None = None  # the same on the host, where the exchange already read it there
    mask_NK: torch.Tensor | None = None  # 0 where a held row's choice has no expert row here (None: all 1)


@dataclass(frozen=True, kw_only=True)
class LeanDispatchMetadata:
    route: ExpertRoute
    state: object  # the dispatcher's own record of the exchange, for the return trip (None at EP=1)


@dataclass(frozen=True, kw_only=True)
class _SentRows:
    """What the sender of an all-to-all exchange keeps for the return trip and its per-token sum."""

    src_N: torch.Tensor
    slot_TK: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]


def _padded(counts: list[int], multiple: int) -> list[int]:
    return [-(-c // multiple) * multiple for c in counts]


class LeanTokenDispatcher(AllToAllTokenDispatcher):
    """TorchTitan's dispatcher interface, with gathers (and their dual gathers) instead of sorting scatters.

    EP=1: the tokens are the held rows and the lean permutation lays out the expert rows.
    EP>1: one count exchange (one host read of the split sizes), one all-to-all of the
    routed rows (and their scores) each way; the rows arrive rank-major and the same lean
    permutation, over their local expert ids, lays them out expert-major; the scores are
    applied there, as at EP=1 (so fp8's score gradient is the EP=1 one); the return trip is
    the weighted inverse gather, the all-to-all back, and the sender's per-token sum.

    `exchange` / `give_back` are the two ends; `dispatch` / `combine` (what TorchTitan's
    RoutedExperts calls) put the gather into expert-major rows and its dual between them,
    and the fp8 experts fold that gather into their own quantisation pass instead.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pad_multiple: int = 1

    def __init__(self, config: Config):
        super().__init__(config)
        self.pad_multiple = config.pad_multiple

    def exchange(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                 num_local_tokens_per_expert_E: torch.Tensor,
                 pad_multiple: int) -> tuple[torch.Tensor, ExpertRoute, object]:
        """(held rows, their expert route, state for `give_back`)."""
        if self.ep_mesh is None:
            src_R, slot_TK, score_R, counts_E = lean_permutation(
                topk_expert_ids_TK, topk_scores_TK, num_local_tokens_per_expert_E, pad_multiple)
            route = ExpertRoute(src_R=src_R, slot_NK=slot_TK, score_R=score_R, weights_NK=topk_scores_TK,
                                counts_E=counts_E)
            return x_TD, route, None
        return self._exchange_ep(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E, pad_multiple)

    def _exchange_ep(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E, pad_multiple):
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        e = counts_E.numel() // ep
        # global expert order is rank-major: the rows for rank j are one contiguous block
        src_N, slot_TK, _, _ = lean_permutation(topk_expert_ids_TK, topk_scores_TK, counts_E)
        send_ND = _GatherRows.apply(x_TD, src_N, slot_TK, None)
        # the scores travel with their rows and are applied where the experts run, as at EP=1
        choice_N = torch.empty_like(src_N).index_copy_(  # the (token, k) choice of each sent row
            0, slot_TK.reshape(-1), torch.arange(src_N.numel(), device=src_N.device))
        send_N1 = _GatherRows.apply(topk_scores_TK.reshape(-1, 1), choice_N, slot_TK.reshape(-1, 1), None)
        with torch.no_grad():
            recv_SE = torch.empty_like(counts_E).view(ep, e)
            dist.all_to_all_single(recv_SE, counts_E.view(ep, e).contiguous(), group=group)
            host = torch.cat([counts_E, recv_SE.reshape(-1)]).tolist()  # the one host sync
        sent, held = host[:ep * e], host[ep * e:]
        in_splits = [sum(sent[j * e:(j + 1) * e]) for j in range(ep)]
        out_splits = [sum(held[s * e:(s + 1) * e]) for s in range(ep)]
        recv_ND = _AllToAll.apply(send_ND, out_splits, in_splits, group)
        recv_N1 = _AllToAll.apply(send_N1, out_splits, in_splits, group)
        n = recv_ND.size(0)
        with torch.no_grad():
            local_S = torch.arange(ep * e, device=x_TD.device) % e  # local expert of each (source, expert) block
            ids_N1 = local_S.repeat_interleave(recv_SE.reshape(-1), output_size=n)[:, None]
            src_R, slot_N1, score_R, counts_e = lean_permutation(ids_N1, recv_N1, recv_SE.sum(0), pad_multiple)
        per_expert = [sum(held[s * e + l] for s in range(ep)) for l in range(e)]
        route = ExpertRoute(src_R=src_R, slot_NK=slot_N1, score_R=score_R, weights_NK=recv_N1, counts_E=counts_e,
                            counts=_padded(per_expert, pad_multiple))
        return recv_ND, route, _SentRows(src_N=src_N, slot_TK=slot_TK, out_splits=out_splits, in_splits=in_splits)

    def give_back(self, out_ND: torch.Tensor, state) -> torch.Tensor:
        """The held rows' (already weighted) outputs back to their tokens, summed per token: [tokens, dim]."""
        if state is None:
            return out_ND
        back_ND = _AllToAll.apply(out_ND, state.in_splits, state.out_splits, self.ep_mesh.get_group())
        return _CombineRows.apply(back_ND, None, state.src_N, state.slot_TK, None)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        rows_ND, route, state = self.exchange(x_TD, topk_scores_TK, topk_expert_ids_TK,
                                              num_local_tokens_per_expert_E, self.pad_multiple)
        routed_RD = _GatherRows.apply(rows_ND, route.src_R, route.slot_NK, route.mask_NK)
        return routed_RD, route.counts_E, LeanDispatchMetadata(route=route, state=state)

    def combine(self, routed_output_RD, metadata, x_TD):
        route = metadata.route
        out_ND = _CombineRows.apply(routed_output_RD, route.weights_NK, route.src_R, route.slot_NK, route.score_R)
        return self.give_back(out_ND, metadata.state).to(x_TD.dtype)
