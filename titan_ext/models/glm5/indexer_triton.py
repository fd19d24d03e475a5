"""The lightning indexer's scores for queries x keys, as one Triton kernel (CUDA).

Why: the torch path (`dsa._index_scores`) forms every head's `[queries, keys]` score block
(`[C * heads, T]`, 32 heads for GLM-5) before ReLU and the per-token head mix, so its scratch
and memory traffic are `heads` times the result. This kernel keeps one `[BLOCK_M, BLOCK_N]` fp32
accumulator per tile and loops over heads in registers: `scale * ks[t] * sum_h w[c, h] *
relu(q[c, h] . k[t])`, later keys (global key position > the query's) set to -inf, and tiles
wholly in the queries' future skip the matmuls. `ks` is the keys' fp8 scale under vLLM's
ranking (`dsa.indexer_topk(fp8=True)` passes the fp8 values and folds the query scales into
`w`), else 1. fp32 accumulation and mix (the torch path rounds each head's scores to the input
dtype before the ReLU), so in bf16 the two differ by that rounding; in fp32 they agree to
summation order, which is how the unit test compares them under `TRITON_INTERPRET=1`.

fp8 ranking runs as bf16 matmuls of the fp8 values (every e4m3 value is a bf16 value, and bf16
products sum in fp32), not as fp8 matmuls: on the H200 Triton's fp8 `tl.dot` sums with the
tensor cores' reduced-precision accumulator, which in a one-off trial (not kept) made many queries
choose a key set other than vLLM's fp32 ranking, by one key at the boundary; promoting it to fp32
(`max_num_imprecise_acc`) made the kernel several times slower. The GPU kernel case
`test_fp8_indexer_picks_the_keys_vllm_picks_ties_included` checks the bf16 form against vLLM's
ranking. Needs a power-of-two head dim of at least 16 (128 for GLM-5).

Launch settings: BLOCK_M 64, BLOCK_N 128, 4 warps, 3 stages, the fastest of five tile shapes tried
once on the H200 over a 131k-token causal sequence; `benchmarks.dsa_layer` times the whole indexer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3


def supported(q_BCHD: torch.Tensor) -> bool:
    d = q_BCHD.size(-1)
    return d >= 16 and (d & (d - 1)) == 0


@triton.jit
def _scores_kernel(
    Q, K, W, KS, OUT, n_q, n_k, n_heads, g0, t0, scale,
    stride_qc, stride_qh, stride_kt, stride_wc, stride_oc,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mmask, nmask = offs_m < n_q, offs_n < n_k
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if t0 + pid_n * BLOCK_N <= g0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_q) - 1:  # some key not in the future
        k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=nmask[:, None], other=0.0)
        kt = tl.trans(k)
        for h in range(n_heads):
            q = tl.load(Q + offs_m[:, None] * stride_qc + h * stride_qh + offs_d[None, :], mask=mmask[:, None],
                        other=0.0)
            w = tl.load(W + offs_m * stride_wc + h, mask=mmask, other=0.0).to(tl.float32)
            acc += w[:, None] * tl.maximum(tl.dot(q, kt), 0.0)
        if HAS_KS:
            acc = acc * tl.load(KS + offs_n, mask=nmask, other=0.0)[None, :]
    acc = tl.where((t0 + offs_n)[None, :] > (g0 + offs_m)[:, None], float("-inf"), acc * scale)
    tl.store(OUT + offs_m[:, None] * stride_oc + offs_n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def index_scores(q_BCHD: torch.Tensor, k_BTD: torch.Tensor, w_BCH: torch.Tensor, g0: int, t0: int,
                 scale: float, k_scale_BT: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, C, T]` fp32 mixed scores of queries at global positions g0.. against keys at t0..
    (`k_scale_BT`: per-key factors, the fp8 keys' scales)."""
    bsz, c, h, d = q_BCHD.shape
    t = k_BTD.size(1)
    out = torch.empty(bsz, c, t, dtype=torch.float32, device=q_BCHD.device)
    grid = (triton.cdiv(c, BLOCK_M), triton.cdiv(t, BLOCK_N))
    for b in range(bsz):
        q, k, w = q_BCHD[b].contiguous(), k_BTD[b].contiguous(), w_BCH[b].contiguous()
        ks = k if k_scale_BT is None else k_scale_BT[b].float().contiguous()
        _scores_kernel[grid](
            q, k, w, ks, out[b], c, t, h, g0, t0, scale,
            q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(1),
            D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_KS=k_scale_BT is not None,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out
