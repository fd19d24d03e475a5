"""The lightning indexer's scores for a tile of queries x keys, as one Triton kernel (CUDA).

Why: the torch path (`dsa._index_scores`) forms every head's `[queries, keys]` score block
(`[C * heads, T]`, 32 heads for GLM-5) before ReLU and the per-token head mix, so its scratch
and memory traffic are `heads` times the result. This kernel keeps one `[BLOCK_M, BLOCK_N]` fp32
accumulator per tile and loops over heads in registers: `scale * sum_h w[c, h] * relu(q[c, h] .
k[t])`, later keys (global key position > the query's) set to -inf. The running top-k over key
chunks (`dsa._chunk_topk`) stays torch.topk. fp32 accumulation and mix (the torch path rounds
each head's scores to the input dtype before the ReLU), so in bf16 the two differ by that
rounding; in fp32 they agree to summation order, which is how the unit test compares them under
`TRITON_INTERPRET=1`. Needs a power-of-two head dim of at least 16 (128 for GLM-5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 64, 64


def supported(q_BCHD: torch.Tensor) -> bool:
    d = q_BCHD.size(-1)
    return d >= 16 and (d & (d - 1)) == 0


@triton.jit
def _scores_kernel(
    Q, K, W, OUT, n_q, n_k, n_heads, g0, t0, scale,
    stride_qc, stride_qh, stride_kt, stride_wc, stride_oc,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mmask, nmask = offs_m < n_q, offs_n < n_k
    k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=nmask[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for h in range(n_heads):
        q = tl.load(Q + offs_m[:, None] * stride_qc + h * stride_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        w = tl.load(W + offs_m * stride_wc + h, mask=mmask, other=0.0).to(tl.float32)
        acc += w[:, None] * tl.maximum(tl.dot(q, tl.trans(k)), 0.0)
    acc = tl.where((t0 + offs_n)[None, :] > (g0 + offs_m)[:, None], float("-inf"), acc * scale)
    tl.store(OUT + offs_m[:, None] * stride_oc + offs_n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def index_scores(q_BCHD: torch.Tensor, k_BTD: torch.Tensor, w_BCH: torch.Tensor, g0: int, t0: int,
                 scale: float) -> torch.Tensor:
    """`[B, C, T]` fp32 mixed scores of queries at global positions g0.. against keys at t0..."""
    bsz, c, h, d = q_BCHD.shape
    t = k_BTD.size(1)
    out = torch.empty(bsz, c, t, dtype=torch.float32, device=q_BCHD.device)
    grid = (triton.cdiv(c, BLOCK_M), triton.cdiv(t, BLOCK_N))
    for b in range(bsz):
        q, k, w = q_BCHD[b].contiguous(), k_BTD[b].contiguous(), w_BCH[b].contiguous()
        _scores_kernel[grid](
            q, k, w, out[b], c, t, h, g0, t0, scale,
            q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(1),
            D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )
    return out
