"""fp8 training for the MoE block's SwiGLU experts: routed experts and the shared expert.

Every GEMM of forward and backward (x W1|W3, h W2, their input gradients and weight
gradients) runs in fp8 e4m3 with float32 row-wise scales, through one `torch._scaled_mm`
per expert: on the H200 (torch 2.11, `benchmarks/moe_block.py --fp8-probe`) the grouped
`torch._scaled_grouped_mm` ran these GEMMs at 770-1000 TFLOP/s, 1.3x its bf16
`torch._grouped_mm` counterpart, while per-expert dense GEMMs ran 1000-1250 (1.5-1.8x).
The per-expert loop needs the group sizes on the host: one device sync per forward.
cuBLASLt's fp8 GEMMs need every group's row count to be a multiple of 16 (`ROW_MULTIPLE`):
`to_fp8` makes the lean dispatcher pad each expert's group (pad rows carry score 0), and the
shared expert pads its tokens.

Scales: activations per row (per routed row, over the contraction dimension); weights per
output channel; weight gradients per (expert, channel) over the expert's rows. Weights are
quantised once per weight version (four layouts: W1|W3 and W2, each as stored and
transposed) and reused until a parameter changes. Quantisation kernels: `fp8_quant.py`.

`to_fp8(model)` switches every MoE layer of a titan_ext model to this path in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE

from .experts import LeanTokenDispatcher, NativeDtypeGroupedExperts, _local
from .fp8_quant import padded_starts, quant_cols_t, quant_rows, swiglu_bwd_quant_rows, swiglu_quant_rows


ROW_MULTIPLE = 16


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


def quantise_weights(w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> Fp8Weights:
    e, f, d = w1_EFD.shape
    w13 = torch.cat([w1_EFD, w3_EFD], dim=1).reshape(e * 2 * f, d)
    w2 = w2_EDF.reshape(e * d, f)
    (q13, s13), (q2, s2) = quant_rows(w13), quant_rows(w2)
    return Fp8Weights(
        key=_weights_key((w1_EFD, w3_EFD, w2_EDF)),
        w13=(q13.view(e, 2 * f, d), s13.view(e, 2 * f)),
        w2=(q2.view(e, d, f), s2.view(e, d)),
        w13_t=quant_cols_t(w13, [2 * f] * e, stacked=True),
        w2_t=quant_cols_t(w2, [d] * e, stacked=True),
    )


def cached_weights(owner: torch.nn.Module, w1, w3, w2) -> Fp8Weights:
    """The fp8 weights of `owner`, re-quantised only when a parameter changed (version or storage)."""
    cached = owner.__dict__.get("_fp8_weights")
    if cached is None or cached.key != _weights_key((w1, w3, w2)):
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
    """out[e] = a_e^T b_e over expert e's rows, from `quant_cols_t` layouts (a_t rows `rows` only)."""
    (aq, as_), (bq, bs) = a_t, b_t
    starts = padded_starts(counts)
    for e in range(len(counts)):
        p0, p1 = starts[e], starts[e + 1]
        if p1 == p0:
            out[e].zero_()
            continue
        torch._scaled_mm(aq[rows, p0:p1], bq[:, p0:p1].t(), as_[e, rows][:, None], bs[e][None, :],
                         out_dtype=out.dtype, out=out[e])


class _Fp8SwiGLU(torch.autograd.Function):
    """y = (silu(x W1^T) * (x W3^T)) W2^T per expert group, every GEMM in fp8."""

    @staticmethod
    def forward(ctx, x_RD, w1_EFD, w3_EFD, w2_EDF, wq: Fp8Weights, counts: list[int]):
        # w1/w3/w2 are inputs so that autograd hands them their gradients; wq holds their fp8 values.
        x8 = quant_rows(x_RD)
        g13 = _rows_mm(*x8, wq.w13, counts, x_RD.dtype)
        y = _rows_mm(*swiglu_quant_rows(g13), wq.w2, counts, x_RD.dtype)
        xq_t, xs_t = quant_cols_t(x_RD, counts)  # for the W1|W3 gradient; x itself is not kept
        ctx.save_for_backward(g13, xq_t, xs_t)
        ctx.wq, ctx.counts, ctx.w_dtypes = wq, counts, (w1_EFD.dtype, w3_EFD.dtype, w2_EDF.dtype)
        return y

    @staticmethod
    def backward(ctx, dy_RD):
        g13, xq_t, xs_t = ctx.saved_tensors
        wq, counts = ctx.wq, ctx.counts
        dy_RD = dy_RD.contiguous()
        dtype = dy_RD.dtype
        dh = _rows_mm(*quant_rows(dy_RD), wq.w2_t, counts, dtype)
        dg13, dg8, dgs = swiglu_bwd_quant_rows(dh, g13)
        del dh
        dx = _rows_mm(dg8, dgs, wq.w13_t, counts, dtype)
        del dg8, dgs
        e, f, d = len(counts), g13.size(1) // 2, dy_RD.size(1)
        dw2 = torch.empty(e, d, f, dtype=dtype, device=dy_RD.device)
        _wgrad_mm(quant_cols_t(dy_RD, counts), quant_cols_t(g13, counts, swiglu=True), counts, dw2)
        dg_t = quant_cols_t(dg13, counts)
        dw1, dw3 = (torch.empty(e, f, d, dtype=dtype, device=dy_RD.device) for _ in range(2))
        _wgrad_mm(dg_t, (xq_t, xs_t), counts, dw1, slice(0, f))
        _wgrad_mm(dg_t, (xq_t, xs_t), counts, dw3, slice(f, 2 * f))
        grads = (g.to(dt) for g, dt in zip((dw1, dw3, dw2), ctx.w_dtypes))
        return dx, *grads, None, None


def fp8_swiglu(x_RD, w1_EFD, w3_EFD, w2_EDF, counts: list[int], wq: Fp8Weights) -> torch.Tensor:
    """The SwiGLU FFN of expert e on its counts[e] consecutive rows of x, in fp8 (bf16/fp32 out as x)."""
    return _Fp8SwiGLU.apply(x_RD, w1_EFD, w3_EFD, w2_EDF, wq, counts)


class Fp8GroupedExperts(NativeDtypeGroupedExperts):
    """Routed experts whose GEMMs run in fp8 (see the module docstring)."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        counts = num_tokens_per_expert_E.tolist()
        return fp8_swiglu(x_RD, w1, w3, w2, counts, cached_weights(self, w1, w3, w2))


class Fp8FeedForward(FeedForward):
    """The shared expert in fp8: one group of all tokens through the same function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (_local(lin.weight).unsqueeze(0) for lin in (self.w1, self.w3, self.w2))
        x_TD = x.reshape(-1, x.size(-1))
        t = x_TD.size(0)
        x_TD = F.pad(x_TD, (0, 0, 0, -t % ROW_MULTIPLE))
        y = fp8_swiglu(x_TD, w1, w3, w2, [x_TD.size(0)], cached_weights(self, w1, w3, w2))
        return y[:t].view(*x.shape[:-1], y.size(-1))


def to_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Switch the routed and shared experts of every MoE layer in `model` to fp8, in place.

    Parameters stay as they are (bf16 or fp32 masters); only the GEMMs change.
    """
    for m in model.modules():
        if isinstance(m, MoE):
            experts = m.routed_experts.inner_experts
            if type(experts) is not NativeDtypeGroupedExperts:
                raise TypeError(f"fp8 experts replace titan_ext's NativeDtypeGroupedExperts, not {type(experts)}")
            experts.__class__ = Fp8GroupedExperts
            dispatcher = m.routed_experts.token_dispatcher
            if not isinstance(dispatcher, LeanTokenDispatcher) or dispatcher.ep_mesh is not None:
                raise TypeError("fp8 experts need titan_ext's LeanTokenDispatcher without expert parallel "
                                "(it pads each expert's rows to a multiple of 16)")
            dispatcher.pad_multiple = ROW_MULTIPLE
            if m.shared_experts is not None:
                if type(m.shared_experts) is not FeedForward or m.shared_experts.w1.bias is not None:
                    raise TypeError(f"fp8 shared expert needs a bias-free FeedForward, not {type(m.shared_experts)}")
                m.shared_experts.__class__ = Fp8FeedForward
    return model
