"""fp8 training for the MoE block's SwiGLU experts: routed experts and the shared expert.

Every GEMM of forward and backward (x W1|W3, h W2, their input gradients and weight
gradients) runs in fp8 e4m3 with float32 row-wise scales, through one `torch._scaled_mm`
per expert: on the H200 (torch 2.11, `benchmarks/moe_block.py --fp8-probe`) the grouped
`torch._scaled_grouped_mm` ran these GEMMs at 770-1000 TFLOP/s, 1.3x its bf16
`torch._grouped_mm` counterpart, while per-expert dense GEMMs ran 1000-1250 (1.5-1.8x).
The per-expert loop needs the group sizes on the host: one device sync per forward.
cuBLASLt's fp8 GEMMs need every group's row count to be a multiple of 16 (`ROW_MULTIPLE`,
also the row block of the quantisation's column maxima): the routed experts pad each
expert's group (pad rows carry score 0), the shared expert pads its tokens.

The routed experts' fp8 function spans the dispatch and the combine as well (`Route`): the
tokens are quantised once by rows and their fp8 rows gathered into the routed layout, and
so is the block's output gradient in the backward, so no bf16 [routed rows, dim] tensor is
written besides the expert output that the combine reads.

Scales: activations per row (per routed row, over the contraction dimension: a routed row's
scale is its token's); weights per output channel; weight gradients per (expert, channel)
over the expert's rows on one side and per row on the other:
dW13_e = sum_r (dg13[r] s_x[r])^T xq[r] and dW2_e = sum_r gq[r]^T (h[r] score[r] s_g[r]),
where xq / gq are the fp8 rows of x / g that the GEMMs of x W13^T and dy W2 use (moved into
the transposed per-expert layout, not quantised again) and s_x / s_g their row scales,
folded into the column quantisation of dg13 / h. So neither x nor dy is quantised by
columns (at Kimi-K2's 64k tokens those passes read [524288, 7168] bf16 through the gather
index, 4.7 and 5.1 ms), and h's column pass reads g13 once the backward knows s_g.

The score gradient <g[t], y[r]> (row r of token t) is computed as <dh[r], h[r]> with dh the
gradient of y[r] / score[r] = h[r] W2^T: the W2 input gradient runs on the unscaled rows
g[src[r]] and the SwiGLU backward kernel, which reads h's inputs anyway, scales dh by the
score and takes the dot. y is not saved for the backward (7.5 GB at that size) nor re-read.

Weights are quantised once per weight version (four layouts: W1|W3 and W2, each as stored
and transposed) and reused until a parameter changes. Quantisation kernels: `fp8_quant.py`.

Under expert parallel the dispatcher's exchange (`experts.LeanTokenDispatcher.exchange`)
brings the routed rows to the experts' rank, and its expert-major layout is this function's
route: the gather that lays the received rows out by expert is the quantisation's own gather,
and the per-expert row counts ride on the exchange's one host read of the split sizes (no
further host sync). The scores travel with the rows and are applied here, as at EP=1.

`to_fp8(model)` switches every MoE layer of a titan_ext model to this path in place;
`builder.configure_moe(..., fp8=True)` builds it so (`--titan_ext.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE, RoutedExperts

from .experts import LeanTokenDispatcher, NativeDtypeGroupedExperts, _local, gather_sum
from .fp8_quant import (
    ROW_BLOCK, padded_starts, quant_cols_t, quant_rows, swiglu_bwd_quant_rows, swiglu_quant_rows, transpose_groups)


ROW_MULTIPLE = ROW_BLOCK


@dataclass(frozen=True)
class Fp8Weights:
    """One expert stack's weights in fp8, each as (q [E, N, K], scale [E, N]) for `_scaled_mm`'s right operand."""

    key: tuple
    w13: tuple[torch.Tensor, torch.Tensor]  # [E, 2F, D]: forward x -> [g1 | g3]
    w2: tuple[torch.Tensor, torch.Tensor]  # [E, D, F]: forward h -> y
    w13_t: tuple[torch.Tensor, torch.Tensor]  # [E, D, 2F]: input gradient dg13 -> dx
    w2_t: tuple[torch.Tensor, torch.Tensor]  # [E, F, D]: input gradient dy -> dh


def _weights_key(ws) -> tuple:
    return tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in ws)


@torch.no_grad()
def quantise_weights(w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> Fp8Weights:
    """Outside autograd: the fp8 copies reach `_Fp8SwiGLU` as a plain argument, whose backward computes the
    weight gradients itself. Tracked, the quantisation's saved tensors would count toward activation
    checkpointing's, and a cache hit in the recomputation (same storage, same version) saves fewer than the
    forward's miss did: `CheckpointError: A different number of tensors was saved` (422 against 86) in 2 of 5
    runs of `torchtitan train --titan_ext.fp8` with EP 2, none in 4 runs since."""
    e, f, d = w1_EFD.shape
    w1, w3 = w1_EFD.reshape(e * f, d), w3_EFD.reshape(e * f, d)  # read as [W1_e; W3_e] per expert
    w2 = w2_EDF.reshape(e * d, f)
    r13, r2 = quant_rows(w1, interleave=(w3, f)), quant_rows(w2)
    return Fp8Weights(
        key=_weights_key((w1_EFD, w3_EFD, w2_EDF)),
        w13=(r13.q.view(e, 2 * f, d), r13.scale.view(e, 2 * f)),
        w2=(r2.q.view(e, d, f), r2.scale.view(e, d)),
        w13_t=quant_cols_t(w1, [2 * f] * e, r13.colmax, stacked=True, interleave=(w3, f)),
        w2_t=quant_cols_t(w2, [d] * e, r2.colmax, stacked=True),
    )


def cached_weights(owner: torch.nn.Module, w1, w3, w2) -> Fp8Weights:
    """The fp8 weights of `owner`, re-quantised only when a parameter changed (version or storage).

    The quantisation runs outside any dispatch mode: the cache can hit in a checkpointed forward and
    miss in its recompute (FSDP may move the storage in between), and selective activation
    checkpointing, which counts every op it sees, fails a backward that meets ops its forward did not
    (`aten.amax.default invocation index 10 encountered during backward but not found in storage`)."""
    cached = owner.__dict__.get("_fp8_weights")
    if cached is None or cached.key != _weights_key((w1, w3, w2)):
        with _disable_current_modes():
            cached = quantise_weights(w1, w3, w2)
        owner.__dict__["_fp8_weights"] = cached
    return cached


def drop_cached_weights(model: torch.nn.Module) -> None:
    """Forget every cached fp8 weight (the next forward quantises again)."""
    for m in model.modules():
        m.__dict__.pop("_fp8_weights", None)


def _rows_mm(a_RK, sa_R, b, counts: list[int], dtype) -> torch.Tensor:
    """out[rows of expert e] = a[rows] @ b[e]^T, dequantised: rows of a grouped by counts."""
    bq, bs = b
    out = torch.empty(a_RK.size(0), bq.size(1), dtype=dtype, device=a_RK.device)
    s = 0
    for e, n in enumerate(counts):
        if n:
            torch._scaled_mm(a_RK[s:s + n], bq[e].t(), sa_R[s:s + n, None], bs[e][None, :], out_dtype=dtype,
                             out=out[s:s + n])
        s += n
    return out


def _wgrad_mm(a_t, b_t, counts: list[int], out: torch.Tensor, rows: slice = slice(None)) -> None:
    """out[e] = a_e^T b_e over expert e's rows: a_t, b_t = (q, scale [G, n]) from `quant_cols_t`
    or (q, None) from `transpose_groups` (scale 1: its row scales are folded into the other
    operand); a_t's rows `rows` only."""
    (aq, as_), (bq, bs) = a_t, b_t
    ones = torch.ones(max(aq.size(0), bq.size(0)), dtype=torch.float32, device=aq.device)
    starts = padded_starts(counts)
    for e in range(len(counts)):
        p0, p1 = starts[e], starts[e + 1]
        if p1 == p0:
            out[e].zero_()
            continue
        sa = ones[:out.size(1)] if as_ is None else as_[e, rows]
        sb = ones[:out.size(2)] if bs is None else bs[e]
        torch._scaled_mm(aq[rows, p0:p1], bq[:, p0:p1].t(), sa[:, None], sb[None, :], out_dtype=out.dtype, out=out[e])


@dataclass(frozen=True)
class Route:
    """The routed experts' lean dispatch (`experts.lean_permutation`, groups padded to ROW_MULTIPLE)."""

    src_R: torch.Tensor  # token (held row) of each routed row
    slot_TK: torch.Tensor  # routed rows of each token
    score_R: torch.Tensor  # routing score of each routed row (pad rows: 0)
    mask_TK: torch.Tensor | None = None  # 0 where a token's choice has no routed row here (None: all 1)


class _Fp8SwiGLU(torch.autograd.Function):
    """y = (silu(x W1^T) * (x W3^T)) W2^T per expert group, every GEMM in fp8.

    With a route the function spans dispatch and combine too: row r is x[src[r]] and the
    output is out[t] = sum_k scores[t, k] y[slot[t, k]]. Owning both ends lets the dispatch
    move fp8 rows of the tokens quantised once, and the backward quantise the routed output
    gradient's rows g[src[r]] from g without writing them (the bf16 routed copy of x, its row
    pass, and the combine backward's [rows, dim] write are gone); the score multiplies dh in
    the SwiGLU backward, which also gives the score gradient (module docstring).
    """

    @staticmethod
    def forward(ctx, x_TD, scores_TK, w1_EFD, w3_EFD, w2_EDF, wq: Fp8Weights, counts: list[int],
                route: Route | None):
        # w1/w3/w2 are inputs so that autograd hands them their gradients; wq holds their fp8 values.
        dtype = x_TD.dtype
        x8 = quant_rows(x_TD, colmax=False)  # the tokens (route) or the rows
        xg = transpose_groups(x8.q, counts, None if route is None else route.src_R, x8.scale)
        del x8
        g13 = _rows_mm(xg.q, xg.scale, wq.w13, counts, dtype)
        h8 = swiglu_quant_rows(g13)
        y = _rows_mm(h8.q, h8.scale, wq.w2, counts, dtype)
        ctx.wq, ctx.counts, ctx.route = wq, counts, route
        ctx.w_dtypes = (w1_EFD.dtype, w3_EFD.dtype, w2_EDF.dtype)
        ctx.save_for_backward(g13, xg.t, xg.scale)  # xg.t: W1|W3's weight gradient, with x's row scales
        if route is None:
            return y
        ctx.scores_meta = (scores_TK.shape, scores_TK.dtype)
        return gather_sum(y, route.slot_TK, scores_TK)

    @staticmethod
    def backward(ctx, grad_out):
        g13, xq_t, s_x = ctx.saved_tensors
        wq, counts, route = ctx.wq, ctx.counts, ctx.route
        dtype = grad_out.dtype
        src = score = None
        if route is not None:  # dy[r] = score[r] g[src[r]]: rows g[src[r]] here, the score in the SwiGLU backward
            src, score = route.src_R, route.score_R
        g8 = quant_rows(grad_out.contiguous(), colmax=False)
        gg = transpose_groups(g8.q, counts, src, g8.scale)  # rows g[src[r]] and, transposed, W2's gradient
        del g8
        dh = _rows_mm(gg.q, gg.scale, wq.w2_t, counts, dtype)  # the gradient of y / score
        # dW2 = sum_r (score[r] g[src[r]])^T h[r] = sum_r gq[r]^T (h[r] score[r] s_g[r])
        hmul = gg.scale if score is None else gg.scale * score.float()
        dg13, dg8, h_colmax = swiglu_bwd_quant_rows(dh, g13, s_x, hmul, score)
        del dh
        dx = _rows_mm(dg8.q, dg8.scale, wq.w13_t, counts, dtype)
        e, f, d = len(counts), g13.size(1) // 2, grad_out.size(1)
        dw2 = torch.empty(e, d, f, dtype=dtype, device=grad_out.device)
        _wgrad_mm((gg.t, None), quant_cols_t(g13, counts, h_colmax, mul_R=hmul, swiglu=True), counts, dw2)
        del gg
        dg_t = quant_cols_t(dg13, counts, dg8.colmax, mul_R=s_x)  # dW13 = sum_r (dg13[r] s_x[r])^T xq[r]
        del dg13
        dw1, dw3 = (torch.empty(e, f, d, dtype=dtype, device=grad_out.device) for _ in range(2))
        _wgrad_mm(dg_t, (xq_t, None), counts, dw1, slice(0, f))
        _wgrad_mm(dg_t, (xq_t, None), counts, dw3, slice(f, 2 * f))
        grads = (g.to(dt) for g, dt in zip((dw1, dw3, dw2), ctx.w_dtypes))
        grad_scores = None
        if route is not None:  # the dispatch's backward, and the combine's score gradient
            dx = gather_sum(dx, route.slot_TK, route.mask_TK)
            shape, sdtype = ctx.scores_meta
            grad_scores = dg8.dot.index_select(0, route.slot_TK.reshape(-1)).view(shape).to(sdtype)
        return dx, grad_scores, *grads, None, None, None


def fp8_swiglu(x_RD, w1_EFD, w3_EFD, w2_EDF, counts: list[int], wq: Fp8Weights, route: Route | None = None,
               scores_TK: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU FFN of expert e on its counts[e] consecutive rows of x, in fp8 (bf16/fp32 out as x).

    With a route: the rows are x[route.src_R] and the output is combined per token with scores_TK.
    """
    return _Fp8SwiGLU.apply(x_RD, scores_TK, w1_EFD, w3_EFD, w2_EDF, wq, counts, route)


class Fp8RoutedExperts(RoutedExperts):
    """Exchange, routed experts and return in one fp8 function (see `_Fp8SwiGLU`) over the route
    of a lean-family dispatcher (`experts.LeanTokenDispatcher`), groups padded to ROW_MULTIPLE."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        _check_fp8_parts(self)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        b, l, d = x_BLD.shape
        k = topk_scores_BLK.size(-1)
        rows_ND, route, state = self.token_dispatcher.exchange(
            x_BLD.reshape(b * l, d), topk_scores_BLK.reshape(b * l, k), topk_expert_ids_BLK.reshape(b * l, k),
            num_local_tokens_per_expert_E, ROW_MULTIPLE)
        counts = route.counts if route.counts is not None else route.counts_E.tolist()  # EP=1: the one host sync
        r = sum(counts)  # the permutation's static row count leaves slack rows after the last group
        experts = self.inner_experts
        w1, w2, w3 = (_local(w) for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))
        out_ND = fp8_swiglu(rows_ND, w1, w3, w2, counts, cached_weights(experts, w1, w3, w2),
                            Route(route.src_R[:r], route.slot_NK, route.score_R[:r], route.mask_NK), route.weights_NK)
        return self.token_dispatcher.give_back(out_ND, state).to(x_BLD.dtype).view(b, l, d)


def _check_fp8_parts(routed: RoutedExperts) -> None:
    if type(routed.inner_experts) is not NativeDtypeGroupedExperts:
        raise TypeError(f"fp8 experts replace titan_ext's NativeDtypeGroupedExperts, not {type(routed.inner_experts)}")
    if not isinstance(routed.token_dispatcher, LeanTokenDispatcher):
        raise TypeError("fp8 experts need a lean-family dispatcher (lean or deepep), "
                        f"not {type(routed.token_dispatcher).__name__}")


class Fp8FeedForward(FeedForward):
    """The shared expert in fp8: one group of all tokens through the same function."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        if self.w1.bias is not None:
            raise TypeError("fp8 shared expert needs a bias-free FeedForward")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (_local(lin.weight).unsqueeze(0) for lin in (self.w1, self.w3, self.w2))
        x_TD = x.reshape(-1, x.size(-1))
        t = x_TD.size(0)
        pad = -t % ROW_MULTIPLE
        if pad:  # (a no-op pad and slice would still copy x forward and the gradient backward)
            x_TD = F.pad(x_TD, (0, 0, 0, pad))
        y = fp8_swiglu(x_TD, w1, w3, w2, [x_TD.size(0)], cached_weights(self, w1, w3, w2))
        return (y[:t] if pad else y).view(*x.shape[:-1], y.size(-1))


def to_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Switch the routed and shared experts of every MoE layer in `model` to fp8, in place.

    Parameters stay as they are (bf16 or fp32 masters); only the GEMMs change.
    """
    for m in model.modules():
        if isinstance(m, MoE):
            _check_fp8_parts(m.routed_experts)
            m.routed_experts.__class__ = Fp8RoutedExperts
            if m.shared_experts is not None:
                if type(m.shared_experts) is not FeedForward or m.shared_experts.w1.bias is not None:
                    raise TypeError(f"fp8 shared expert needs a bias-free FeedForward, not {type(m.shared_experts)}")
                m.shared_experts.__class__ = Fp8FeedForward
    return model
