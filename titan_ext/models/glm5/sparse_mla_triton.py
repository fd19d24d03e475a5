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

Backward: two passes over each chunk of query tokens, one program per token in each, all heads
together. Pass 1 (`_bwd_dq_kernel`, shaped like the forward) recomputes the scores from the
saved LSE and `dP = dO V^T` once (delta = rowsum(dO * O) formed in the kernel), `dS = P * (dP -
delta) * scale`, accumulates `dq += dS K` in registers and writes dS and P (input dtype, as they
enter the matmuls) to a `[chunk, topk, heads]` scratch. Pass 2 (`_bwd_dkv_kernel`) reads them
back per key block and forms the key gradient `dS^T q + P^T dO` (keys as the matmul M
dimension, heads as K, q and dO held in shared memory as the B operand), added with fp32
atomics into a `[B*S, C]` fp32 buffer, cast to the input dtype at the end. Chunks keep the
scratch near SCRATCH_BYTES. (A single kernel that split the channels over two programs per
token, both recomputing the scores, took more than twice as long.)

Each kernel's time per launch setting, the whole layer's against dense MLA, and the error against
the fp32 torch path: `python -m benchmarks.dsa_layer` (`moe_block_h200.json: dsa_kernels`, `dsa`)
and the GPU check's kernel cases. Pass 2's fp32 atomics are vectorised four wide
(`atom.add.v4.f32`).

Inputs: bf16 (or fp32) `q [B, L, H, C]`, `kv [B, S, C]`, int `idx [B, L, K]` with entries
in `[0, S)`; L == S, or under context parallel a rank's L queries at global `positions` against
the whole sequence's gathered keys (the position of a query, not its row, masks later keys) and
no duplicates within a row (the indexer's top-k); fp32 accumulation. A query
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

# Launch settings per kernel (key-block size, warps, pipeline stages; SPLIT_V for pass 2), the
# first that fits the device's shared memory wins (checked once, at the first launch; the
# interpreter ignores warps and stages). The firsts are the fastest of `benchmarks.dsa_layer`'s
# sweep on the H200 (`dsa_kernels`); the later ones fit GPUs with less shared memory.
FWD_CONFIGS = [
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
]
BWD_CONFIGS = [{"BLOCK_N": 64, "num_warps": 8, "num_stages": 1}, {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1}]
DKV_CONFIGS = [
    {"BLOCK_N": 64, "SPLIT_V": 2, "num_warps": 4, "num_stages": 1},
    {"BLOCK_N": 64, "SPLIT_V": 2, "num_warps": 8, "num_stages": 1},
    {"BLOCK_N": 32, "SPLIT_V": 2, "num_warps": 4, "num_stages": 1},
]
CONFIGS = {"fwd": FWD_CONFIGS, "bwd": BWD_CONFIGS, "dkv": DKV_CONFIGS}
# dS and P scratch of the backward (bytes, both together): 2 GiB is 4096 tokens at 64 heads, top-2048, bf16.
SCRATCH_BYTES = 2 << 30
_CHOSEN: dict[str, int] = {}


def _launch(kind: str, kernel, grid, args, consts, config: dict | None):
    """Launch with `config`, or with the first entry of the kind's list that compiles here."""
    configs = [config] if config is not None else CONFIGS[kind]
    start = _CHOSEN.get(kind, 0) if config is None else 0
    for i in range(start, len(configs)):
        cfg = dict(configs[i])
        meta = {k: cfg.pop(k) for k in list(cfg) if k.isupper()}  # BLOCK_N, SPLIT_V: constexprs
        try:
            kernel[grid](*args, **meta, **consts, **cfg)
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
def _token_pos(POS, tok, q_len, kv_len):
    """Global position of flat query token `tok` and the first kv row of its batch row."""
    loc = tok % q_len
    return tl.load(POS + loc).to(tl.int64), (tok - loc) // q_len * kv_len


@triton.jit
def _query_tile(Q, POS, tok, q_len, kv_len, n_heads, stride_qt, stride_qh,
                D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Position, first kv row of its sequence, offsets, head mask and the query tile of token `tok`."""
    pos, row0 = _token_pos(POS, tok, q_len, kv_len)
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)  # head offsets times a head stride can pass 2**31
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_R)
    hmask = offs_h < n_heads
    q_ptr = Q + tok * stride_qt + offs_h[:, None] * stride_qh
    q_v = tl.load(q_ptr + offs_v[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(q_ptr + D_V + offs_r[None, :], mask=hmask[:, None], other=0.0)
    return pos, row0, offs_h, offs_v, offs_r, hmask, q_v, q_r


@triton.jit
def _selected_block(q_v, q_r, KV, IDX, tok, pos, row0, n0, topk, stride_it, stride_kvt,
                    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Gather the token's selected rows n0..n0+BLOCK_N (future or padding ones masked, never
    loaded) and their raw scores against every head: (offs_n, valid, k_v, k_r, q k^T)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kidx = tl.load(IDX + tok * stride_it + offs_n, mask=offs_n < topk, other=0).to(tl.int64)
    valid = (offs_n < topk) & (kidx <= pos) & (kidx >= 0)
    k_ptr = KV + (row0 + kidx)[:, None] * stride_kvt
    k_v = tl.load(k_ptr + tl.arange(0, D_V)[None, :], mask=valid[:, None], other=0.0)
    k_r = tl.load(k_ptr + D_V + tl.arange(0, D_R)[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q_v, tl.trans(k_v))
    s = tl.dot(q_r, tl.trans(k_r), s)
    return offs_n, valid, k_v, k_r, s


@triton.jit
def _fwd_kernel(
    Q, KV, IDX, O, LSE, POS,
    q_len, kv_len, n_heads, topk, qk_scale,  # qk_scale = softmax scale * log2(e)
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # flat query token b * q_len + local row
    pos, row0, offs_h, offs_v, offs_r, hmask, q_v, q_r = _query_tile(Q, POS, tok, q_len, kv_len, n_heads, stride_qt,
                                                                     stride_qh, D_V, D_R, BLOCK_H)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        offs_n, valid, k_v, k_r, s = _selected_block(q_v, q_r, KV, IDX, tok, pos, row0, n0, topk, stride_it,
                                                     stride_kvt, D_V, D_R, BLOCK_N)
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
def _bwd_dq_kernel(
    Q, KV, IDX, O, DO, LSE, DQ, DS, PS, POS,
    tok0, q_len, kv_len, n_heads, topk, scale, qk_scale,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Pass 1, one program per query token (all heads): recompute P from the saved LSE and
    # dP = dO V^T once, dS = P * (dP - delta) * scale; dq += dS K in registers; dS and P go
    # (in the input dtype, as they enter the matmuls) to the scratch [chunk, topk, heads].
    loc = tl.program_id(0).to(tl.int64)
    tok = tok0 + loc
    pos, row0, offs_h, offs_v, offs_r, hmask, q_v, q_r = _query_tile(Q, POS, tok, q_len, kv_len, n_heads, stride_qt,
                                                                     stride_qh, D_V, D_R, BLOCK_H)
    do = tl.load(DO + tok * stride_dot + offs_h[:, None] * stride_doh + offs_v[None, :], mask=hmask[:, None], other=0.0)
    o = tl.load(O + tok * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :], mask=hmask[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO * O), fp32
    # Padded heads: LSE +inf makes their probabilities (hence every contribution) zero.
    lse2 = tl.load(LSE + tok * n_heads + offs_h, mask=hmask, other=float("inf")) * 1.4426950408889634
    s_ptr = DS + loc * topk * n_heads + offs_h[:, None]
    p_ptr = PS + loc * topk * n_heads + offs_h[:, None]

    dq_v = tl.zeros([BLOCK_H, D_V], tl.float32)
    dq_r = tl.zeros([BLOCK_H, D_R], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        offs_n, valid, k_v, k_r, s = _selected_block(q_v, q_r, KV, IDX, tok, pos, row0, n0, topk, stride_it,
                                                     stride_kvt, D_V, D_R, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_v))
        ds = (p * (dp - delta[:, None]) * scale).to(k_v.dtype)
        smask = hmask[:, None] & (offs_n < topk)[None, :]
        tl.store(s_ptr + offs_n[None, :] * n_heads, ds, mask=smask)
        tl.store(p_ptr + offs_n[None, :] * n_heads, p.to(k_v.dtype), mask=smask)
        dq_v = tl.dot(ds, k_v, dq_v)
        dq_r = tl.dot(ds, k_r, dq_r)
    dq_ptr = DQ + tok * stride_dqt + offs_h[:, None] * stride_dqh
    tl.store(dq_ptr + offs_v[None, :], dq_v.to(DQ.dtype.element_ty), mask=hmask[:, None])
    tl.store(dq_ptr + D_V + offs_r[None, :], dq_r.to(DQ.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _bwd_dkv_kernel(
    Q, DO, IDX, DS, PS, DKV, POS,
    tok0, q_len, kv_len, n_heads, topk,
    stride_qt, stride_qh, stride_it, stride_dot, stride_doh,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_V: tl.constexpr,
):
    # Pass 2, one program per query token: per block of its selected keys, the key gradient
    # dS^T q (+ P^T dO on the value channels) with the keys as the matmul M dimension and the
    # heads as K; fp32 atomics into the [B*S, C] buffer. SPLIT_V=2 does the value channels as
    # two halves (smaller fp32 tiles to convert for the atomics), the same arithmetic.
    loc = tl.program_id(0).to(tl.int64)
    tok = tok0 + loc
    pos, row0 = _token_pos(POS, tok, q_len, kv_len)
    W: tl.constexpr = D_V // SPLIT_V
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)  # head offsets times a head stride can pass 2**31
    offs_a = tl.arange(0, W)
    offs_r = tl.arange(0, D_R)
    hmask = offs_h < n_heads
    q_ptr = Q + tok * stride_qt + offs_h[:, None] * stride_qh
    do_ptr = DO + tok * stride_dot + offs_h[:, None] * stride_doh
    q_a = tl.load(q_ptr + offs_a[None, :], mask=hmask[:, None], other=0.0)
    do_a = tl.load(do_ptr + offs_a[None, :], mask=hmask[:, None], other=0.0)
    if SPLIT_V == 2:
        q_b = tl.load(q_ptr + W + offs_a[None, :], mask=hmask[:, None], other=0.0)
        do_b = tl.load(do_ptr + W + offs_a[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(q_ptr + D_V + offs_r[None, :], mask=hmask[:, None], other=0.0)
    s_ptr = DS + loc * topk * n_heads + offs_h[None, :]
    p_ptr = PS + loc * topk * n_heads + offs_h[None, :]
    for n0 in range(0, topk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kidx = tl.load(IDX + tok * stride_it + offs_n, mask=offs_n < topk, other=0).to(tl.int64)
        valid = (offs_n < topk) & (kidx <= pos) & (kidx >= 0)
        m = valid[:, None] & hmask[None, :]
        ds_t = tl.load(s_ptr + offs_n[:, None] * n_heads, mask=m, other=0.0)  # [keys, heads]
        p_t = tl.load(p_ptr + offs_n[:, None] * n_heads, mask=m, other=0.0)
        dkv_ptr = DKV + (row0 + kidx)[:, None] * (D_V + D_R)
        dk_a = tl.dot(ds_t, q_a)
        dk_a = tl.dot(p_t, do_a, dk_a)
        tl.atomic_add(dkv_ptr + offs_a[None, :], dk_a, mask=valid[:, None], sem="relaxed")
        if SPLIT_V == 2:
            dk_b = tl.dot(ds_t, q_b)
            dk_b = tl.dot(p_t, do_b, dk_b)
            tl.atomic_add(dkv_ptr + W + offs_a[None, :], dk_b, mask=valid[:, None], sem="relaxed")
        dk_r = tl.dot(ds_t, q_r)
        tl.atomic_add(dkv_ptr + D_V + offs_r[None, :], dk_r, mask=valid[:, None], sem="relaxed")


def _block_h(n_heads: int) -> int:
    return max(16, triton.next_power_of_2(n_heads))


def _flat(q, kv, idx, positions):
    """Flat q, kv, idx, and the queries' global positions (`arange(L)` when None: L == S)."""
    bsz, q_len, n_heads, c = q.shape
    q = q.reshape(bsz * q_len, n_heads, c)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv = kv.reshape(bsz * kv.size(1), c).contiguous()
    idx = idx.reshape(bsz * q_len, idx.size(-1)).contiguous()
    pos = torch.arange(q_len, device=q.device) if positions is None else positions.to(q.device, torch.int64)
    return q, kv, idx, pos.contiguous()


def sparse_mla_fwd(q, kv, idx, scale: float, v_dim: int, config: dict | None = None, *, positions=None):
    """Forward: (out [B, L, H, v_dim] in q's dtype, lse [B, L, H] fp32, natural log). `positions`
    ([L], the queries' global positions; kv holds the S keys of the whole sequence) for context
    parallel; None when q and kv cover the same L == S tokens."""
    bsz, q_len, n_heads, c = q.shape
    qf, kvf, idxf, pos = _flat(q, kv, idx, positions)
    out = q.new_empty(bsz * q_len, n_heads, v_dim)
    lse = torch.empty(bsz * q_len, n_heads, dtype=torch.float32, device=q.device)
    args = (
        qf, kvf, idxf, out, lse, pos,
        q_len, kv.size(1), n_heads, idxf.size(1), scale * LOG2E,
        qf.stride(0), qf.stride(1), kvf.stride(0), idxf.stride(0), out.stride(0), out.stride(1),
    )
    consts = {"D_V": v_dim, "D_R": c - v_dim, "BLOCK_H": _block_h(n_heads)}
    _launch("fwd", _fwd_kernel, (bsz * q_len,), args, consts, config)
    return out.view(bsz, q_len, n_heads, v_dim), lse.view(bsz, q_len, n_heads)


def sparse_mla_bwd(
    q, kv, idx, out, lse, dout, scale: float,
    config: dict | None = None, dkv_config: dict | None = None, chunk_tokens: int | None = None, *, positions=None,
):
    """Backward: (dq like q, dkv like kv). Two passes per chunk of query tokens (the dS / P
    scratch is `2 * topk * heads` elements per token, so chunks keep it near SCRATCH_BYTES)."""
    bsz, q_len, n_heads, c = q.shape
    kv_len = kv.size(1)
    v_dim = out.size(-1)
    qf, kvf, idxf, pos = _flat(q, kv, idx, positions)
    dof = dout.reshape(bsz * q_len, n_heads, v_dim)
    if dof.stride(-1) != 1:
        dof = dof.contiguous()
    of = out.reshape(bsz * q_len, n_heads, v_dim)
    lsef = lse.reshape(bsz * q_len, n_heads).contiguous()
    n_tok, topk = idxf.shape
    dq = torch.empty_like(qf)
    dkv = torch.zeros(bsz * kv_len, c, dtype=torch.float32, device=q.device)
    if chunk_tokens is None:
        chunk_tokens = max(1, SCRATCH_BYTES // (2 * topk * n_heads * q.element_size()))
    chunk = min(n_tok, chunk_tokens)
    ds = q.new_empty(chunk, topk, n_heads)
    ps = q.new_empty(chunk, topk, n_heads)
    consts = {"D_V": v_dim, "D_R": c - v_dim, "BLOCK_H": _block_h(n_heads)}
    for tok0 in range(0, n_tok, chunk):
        n = min(chunk, n_tok - tok0)
        args = (
            qf, kvf, idxf, of, dof, lsef, dq, ds, ps, pos,
            tok0, q_len, kv_len, n_heads, topk, scale, scale * LOG2E,
            qf.stride(0), qf.stride(1), kvf.stride(0), idxf.stride(0), of.stride(0), of.stride(1),
            dof.stride(0), dof.stride(1), dq.stride(0), dq.stride(1),
        )
        _launch("bwd", _bwd_dq_kernel, (n,), args, consts, config)
        args = (
            qf, dof, idxf, ds, ps, dkv, pos,
            tok0, q_len, kv_len, n_heads, topk,
            qf.stride(0), qf.stride(1), idxf.stride(0), dof.stride(0), dof.stride(1),
        )
        _launch("dkv", _bwd_dkv_kernel, (n,), args, consts, dkv_config)
    return dq.view(q.shape), dkv.view(kv.shape).to(kv.dtype)


class SparseLatentAttentionTriton(torch.autograd.Function):
    """Same contract as `dsa._SparseLatentAttention` (minus the chunk size), in Triton."""

    @staticmethod
    def forward(ctx, q_BLHC, kv_BSC, idx_BLK, scale: float, v_dim: int, positions=None):
        out, lse = sparse_mla_fwd(q_BLHC, kv_BSC, idx_BLK, scale, v_dim, positions=positions)
        ctx.save_for_backward(q_BLHC, kv_BSC, idx_BLK, out, lse, positions)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout_BLHV):
        q, kv, idx, out, lse, positions = ctx.saved_tensors
        dq, dkv = sparse_mla_bwd(q, kv, idx, out, lse, dout_BLHV, ctx.scale, positions=positions)
        return dq, dkv, None, None, None, None


def sparse_latent_attention(q_BLHC, kv_BSC, idx_BLK, scale: float, v_dim: int, positions=None) -> torch.Tensor:
    """`positions`: the queries' global positions `[L]` under context parallel (kv: all S tokens)."""
    return SparseLatentAttentionTriton.apply(q_BLHC, kv_BSC, idx_BLK, scale, v_dim, positions)


__all__ = ["SparseLatentAttentionTriton", "sparse_latent_attention", "sparse_mla_fwd", "sparse_mla_bwd", "supported"]
