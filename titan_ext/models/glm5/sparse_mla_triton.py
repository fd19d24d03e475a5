"""Sparse latent attention (DSA's main attention) as Triton kernels, forward and backward.

Why: `dsa._SparseLatentAttention` in plain torch gathers a `[chunk, topk, 576]` copy of the
selected keys for every chunk of queries, materialises fp32 scores and scatters key gradients
with `index_add_`; at 32k tokens it ran slower than dense causal MLA. These kernels compute
the same function without materialising any of that.

How (MLA "MQA mode"): every head of one query token attends to the same selected latent rows
`kv[idx]` (`v_dim + rope_dim` wide; the first `v_dim` channels are also the value). One
program handles one query token with its heads as the M dimension of the matmuls (padded to
at least 16), and walks its `topk` indices in blocks of `BLOCK_N`: it gathers those rows with
a pointer load driven by the index vector, scores them against all heads, and keeps an online
softmax (base-2 exponentials, fp32 statistics). An index after the query's position is
masked (and never loaded), as in the torch path. Forward saves the natural-log LSE per head.

Backward: two programs per query token, each owning one half of the value/latent channels
(half 0 also the rope channels): the accumulator of a whole `[64 heads, 576]` dq plus the
key-block gradients did not fit one program's registers and shared memory. Both halves
recompute the full scores from the saved LSE and `dP = dO V^T` (delta = rowsum(dO * O) is
formed in the kernel); per key block `dS = P * (dP - delta) * scale`, `dq_half += dS K_half`
in registers, and the key block's gradient `dS^T q_half + P^T dO_half` goes with fp32 atomics
into a `[B*S, C]` fp32 buffer, cast to the input dtype at the end. Written as `trans(dS) @ q`
(q as the value-like operand): the transposed form `trans(q) @ dS` read shared memory out of
bounds on sm_90 with Triton 3.6 (compute-sanitizer).

Measured on one H200 (Triton 3.6, 32k tokens, 64 heads, top-2048, 512 + 64, causal random
selection): forward 53 ms (177 TFLOP/s), backward 356 ms (93 TFLOP/s; the 2x score recompute,
small M=16 matmuls for the key gradients, some register spills and 38.6G fp32 atomics). The
backward is where further work pays. (In that run delta was still a torch rowsum over fp32
copies of dO and O, about 50 GiB of temporaries at 128k tokens; it is now formed in the
kernel, not yet re-measured there.)

Inputs: bf16 (or fp32) `q [B, S, H, C]`, `kv [B, S, C]`, int `idx [B, S, K]` with entries
in `[0, S)` and no duplicates within a row (the indexer's top-k); fp32 accumulation. A query
whose selected indices are all in the future gets output 0 and no gradient (the torch path
gives NaN there; the indexer never produces such a row). `v_dim` and `C - v_dim` must be
powers of two (512 + 64 for GLM-5). Runs under `TRITON_INTERPRET=1` on CPU tensors, which is
how the unit tests compare it with the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = 1.4426950408889634

# Launch settings per direction (key-block size, warps, pipeline stages), first that fits the
# device's shared memory wins (checked once, at the first launch; the interpreter ignores
# warps and stages). The backward's first choice needs about 226 KiB of shared memory on
# sm_90 with Triton 3.7: q and dO are held both as the score matmuls' A operand and as the
# key-gradient matmul's B operand. The second fits easily but spills registers.
FWD_CONFIGS = [{"BLOCK_N": 32, "num_warps": 8, "num_stages": 3}, {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1}]
BWD_CONFIGS = [{"BLOCK_N": 16, "num_warps": 8, "num_stages": 1}, {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1}]
_CHOSEN: dict[str, int] = {}


def _launch(kind: str, kernel, grid, args, consts, config: dict | None):
    """Launch with `config`, or with the first entry of the kind's list that compiles here."""
    configs = [config] if config is not None else (FWD_CONFIGS if kind == "fwd" else BWD_CONFIGS)
    start = _CHOSEN.get(kind, 0) if config is None else 0
    for i in range(start, len(configs)):
        cfg = dict(configs[i])
        block_n = cfg.pop("BLOCK_N")
        try:
            kernel[grid](*args, BLOCK_N=block_n, **consts, **cfg)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        if config is None:
            _CHOSEN[kind] = i
        return


def supported(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> bool:
    """True when the kernels handle these shapes (power-of-two value and rope widths)."""
    rope = kv.size(-1) - v_dim

    def pow2(n):
        return n >= 16 and (n & (n - 1)) == 0

    return v_dim >= 32 and pow2(v_dim) and pow2(rope) and q.size(-1) == kv.size(-1)


@triton.jit
def _fwd_kernel(
    Q, KV, IDX, O, LSE,
    seqlen, n_heads, topk, qk_scale,  # qk_scale = softmax scale * log2(e)
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # flat query token b * seqlen + pos
    pos = tok % seqlen
    row0 = tok - pos  # first kv row of this batch element
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_R)
    hmask = offs_h < n_heads
    q_ptr = Q + tok * stride_qt + offs_h[:, None] * stride_qh
    q_v = tl.load(q_ptr + offs_v[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(q_ptr + D_V + offs_r[None, :], mask=hmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kidx = tl.load(IDX + tok * stride_it + offs_n, mask=offs_n < topk, other=0).to(tl.int64)
        valid = (offs_n < topk) & (kidx <= pos) & (kidx >= 0)
        k_ptr = KV + (row0 + kidx)[:, None] * stride_kvt
        k_v = tl.load(k_ptr + offs_v[None, :], mask=valid[:, None], other=0.0)
        k_r = tl.load(k_ptr + D_V + offs_r[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_v, tl.trans(k_v))
        s = tl.dot(q_r, tl.trans(k_r), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_v.dtype), k_v, acc)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    # Natural-log LSE; +inf for a row with no valid key makes its backward probabilities 0.
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    o_ptr = O + tok * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE + tok * n_heads + offs_h, lse, mask=hmask)


@triton.jit
def _bwd_kernel(
    Q, KV, IDX, O, DO, LSE, DQ, DKV,
    seqlen, n_heads, topk, scale, qk_scale,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (token, half): both halves recompute the full scores and dP; each owns one half
    # ("a") of the value/latent channels for dq and dkv, half 0 also the rope channels.
    tok = (tl.program_id(0) // 2).to(tl.int64)  # the two halves of a token run side by side
    half = tl.program_id(0) % 2
    pos = tok % seqlen
    row0 = tok - pos
    HALF: tl.constexpr = D_V // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_a = half * HALF + tl.arange(0, HALF)
    offs_b = (1 - half) * HALF + tl.arange(0, HALF)
    offs_r = D_V + tl.arange(0, D_R)
    hmask = offs_h < n_heads
    q_ptr = Q + tok * stride_qt + offs_h[:, None] * stride_qh
    q_a = tl.load(q_ptr + offs_a[None, :], mask=hmask[:, None], other=0.0)
    q_b = tl.load(q_ptr + offs_b[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(q_ptr + offs_r[None, :], mask=hmask[:, None], other=0.0)
    do_ptr = DO + tok * stride_dot + offs_h[:, None] * stride_doh
    do_a = tl.load(do_ptr + offs_a[None, :], mask=hmask[:, None], other=0.0)
    do_b = tl.load(do_ptr + offs_b[None, :], mask=hmask[:, None], other=0.0)
    # Padded heads: LSE +inf makes their probabilities (hence every contribution) zero.
    lse2 = tl.load(LSE + tok * n_heads + offs_h, mask=hmask, other=float("inf")) * 1.4426950408889634
    # delta = rowsum(dO * O) in fp32, here rather than as a separate pass over [S, H, v_dim].
    o_ptr = O + tok * stride_ot + offs_h[:, None] * stride_oh
    o_a = tl.load(o_ptr + offs_a[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(do_a.to(tl.float32) * o_a, 1)
    o_b = tl.load(o_ptr + offs_b[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    delta += tl.sum(do_b.to(tl.float32) * o_b, 1)

    dq_a = tl.zeros([BLOCK_H, HALF], tl.float32)
    dq_r = tl.zeros([BLOCK_H, D_R], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kidx = tl.load(IDX + tok * stride_it + offs_n, mask=offs_n < topk, other=0).to(tl.int64)
        valid = (offs_n < topk) & (kidx <= pos) & (kidx >= 0)
        rows = row0 + kidx
        k_ptr = KV + rows[:, None] * stride_kvt
        k_a = tl.load(k_ptr + offs_a[None, :], mask=valid[:, None], other=0.0)
        k_b = tl.load(k_ptr + offs_b[None, :], mask=valid[:, None], other=0.0)
        k_r = tl.load(k_ptr + offs_r[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_a, tl.trans(k_a))
        s = tl.dot(q_b, tl.trans(k_b), s)
        s = tl.dot(q_r, tl.trans(k_r), s)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        dp = tl.dot(do_a, tl.trans(k_a))
        dp = tl.dot(do_b, tl.trans(k_b), dp)
        ds = (p * (dp - delta[:, None]) * scale).to(k_a.dtype)
        dq_a = tl.dot(ds, k_a, dq_a)
        dq_r = tl.dot(ds, k_r, dq_r)
        # Key-block gradients [keys, channels]: the transposed probabilities (registers) times
        # q and dO (shared memory, as the value operand of a forward attention).
        dk_a = tl.dot(tl.trans(ds), q_a)
        dk_a = tl.dot(tl.trans(p.to(k_a.dtype)), do_a, dk_a)
        dk_r = tl.dot(tl.trans(ds), q_r)
        dkv_ptr = DKV + rows[:, None] * (D_V + D_R)
        tl.atomic_add(dkv_ptr + offs_a[None, :], dk_a, mask=valid[:, None], sem="relaxed")
        tl.atomic_add(dkv_ptr + offs_r[None, :], dk_r, mask=valid[:, None] & (half == 0), sem="relaxed")
    dq_ptr = DQ + tok * stride_dqt + offs_h[:, None] * stride_dqh
    tl.store(dq_ptr + offs_a[None, :], dq_a.to(DQ.dtype.element_ty), mask=hmask[:, None])
    tl.store(dq_ptr + offs_r[None, :], dq_r.to(DQ.dtype.element_ty), mask=hmask[:, None] & (half == 0))


def _block_h(n_heads: int) -> int:
    return max(16, triton.next_power_of_2(n_heads))


def _flat(q, kv, idx):
    bsz, seqlen, n_heads, c = q.shape
    q = q.reshape(bsz * seqlen, n_heads, c)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv = kv.reshape(bsz * seqlen, c).contiguous()
    idx = idx.reshape(bsz * seqlen, idx.size(-1)).contiguous()
    return q, kv, idx


def sparse_mla_fwd(q, kv, idx, scale: float, v_dim: int, config: dict | None = None):
    """Forward: (out [B, S, H, v_dim] in q's dtype, lse [B, S, H] fp32, natural log)."""
    bsz, seqlen, n_heads, c = q.shape
    qf, kvf, idxf = _flat(q, kv, idx)
    out = q.new_empty(bsz * seqlen, n_heads, v_dim)
    lse = torch.empty(bsz * seqlen, n_heads, dtype=torch.float32, device=q.device)
    args = (
        qf, kvf, idxf, out, lse,
        seqlen, n_heads, idxf.size(1), scale * LOG2E,
        qf.stride(0), qf.stride(1), kvf.stride(0), idxf.stride(0), out.stride(0), out.stride(1),
    )
    consts = {"D_V": v_dim, "D_R": c - v_dim, "BLOCK_H": _block_h(n_heads)}
    _launch("fwd", _fwd_kernel, (bsz * seqlen,), args, consts, config)
    return out.view(bsz, seqlen, n_heads, v_dim), lse.view(bsz, seqlen, n_heads)


def sparse_mla_bwd(q, kv, idx, out, lse, dout, scale: float, config: dict | None = None):
    """Backward: (dq like q, dkv like kv)."""
    bsz, seqlen, n_heads, c = q.shape
    v_dim = out.size(-1)
    qf, kvf, idxf = _flat(q, kv, idx)
    dof = dout.reshape(bsz * seqlen, n_heads, v_dim)
    if dof.stride(-1) != 1:
        dof = dof.contiguous()
    of = out.reshape(bsz * seqlen, n_heads, v_dim)
    lsef = lse.reshape(bsz * seqlen, n_heads).contiguous()
    dq = torch.empty_like(qf)
    dkv = torch.zeros(bsz * seqlen, c, dtype=torch.float32, device=q.device)
    args = (
        qf, kvf, idxf, of, dof, lsef, dq, dkv,
        seqlen, n_heads, idxf.size(1), scale, scale * LOG2E,
        qf.stride(0), qf.stride(1), kvf.stride(0), idxf.stride(0), of.stride(0), of.stride(1),
        dof.stride(0), dof.stride(1), dq.stride(0), dq.stride(1),
    )
    consts = {"D_V": v_dim, "D_R": c - v_dim, "BLOCK_H": _block_h(n_heads)}
    _launch("bwd", _bwd_kernel, (2 * bsz * seqlen,), args, consts, config)
    return dq.view(q.shape), dkv.view(kv.shape).to(kv.dtype)


class SparseLatentAttentionTriton(torch.autograd.Function):
    """Same contract as `dsa._SparseLatentAttention` (minus the chunk size), in Triton."""

    @staticmethod
    def forward(ctx, q_BSHC, kv_BSC, idx_BSK, scale: float, v_dim: int):
        out, lse = sparse_mla_fwd(q_BSHC, kv_BSC, idx_BSK, scale, v_dim)
        ctx.save_for_backward(q_BSHC, kv_BSC, idx_BSK, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout_BSHV):
        q, kv, idx, out, lse = ctx.saved_tensors
        dq, dkv = sparse_mla_bwd(q, kv, idx, out, lse, dout_BSHV, ctx.scale)
        return dq, dkv, None, None, None


def sparse_latent_attention(q_BSHC, kv_BSC, idx_BSK, scale: float, v_dim: int) -> torch.Tensor:
    return SparseLatentAttentionTriton.apply(q_BSHC, kv_BSC, idx_BSK, scale, v_dim)


__all__ = ["SparseLatentAttentionTriton", "sparse_latent_attention", "sparse_mla_fwd", "sparse_mla_bwd", "supported"]
