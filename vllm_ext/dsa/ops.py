"""DeepSeek sparse attention (DSA) as vLLM computes it, in plain torch: the indexer's fp8 keys and
logits, its top-k, and MLA attention over the selected latent keys.

vLLM 0.32 ships DSA kernels for CUDA, ROCm and XPU only; these functions are what the CPU
backends in `vllm_ext.dsa.backend` call, and what the trainer can call to rank keys exactly as
inference did. Nothing here imports vLLM.

The numerics follow vLLM's "fp8 naive" indexer cache (`deepseek_v2.Indexer`,
`indexer_k_quant_and_cache`, `per_token_group_quant_fp8`): each key of `head_dim` (128) values is
stored in fp8 e4m3 with one fp32 scale, `2**ceil(log2(max(amax, 1e-4) / 448))` (a power of two,
"ue8m0"); each query head is quantized the same way with `max(amax, 1e-10)`, its scale folded into
the head's weight. A key's logit is `sum_h relu(q_h . k) * w_h`, each product of fp8 values
accumulated in fp32.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
KEY_EPS = 1e-4
QUERY_EPS = 1e-10


def _ue8m0_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True).clamp_min(eps)
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[T, D]` -> (fp8 values `[T, D]`, fp32 scales `[T]`), vLLM's indexer-cache rule."""
    k = k.float()
    scale = _ue8m0_scale(k, KEY_EPS)
    return (k / scale).to(FP8), scale.squeeze(-1)


def quantize_index_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries `[T, H, D]` -> (fp8 values, fp32 scales `[T, H]`): one group per head, as
    `per_token_group_quant_fp8(q, D, use_ue8m0=True)`."""
    q = q.float()
    scale = _ue8m0_scale(q, QUERY_EPS)
    return (q / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def as_vllm_indexer_sees(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries `[..., H, D]` and keys `[..., D]` as vLLM's indexer ranks them, in fp32: fp8 values
    times their power-of-two scales (exact). Any indexer that scores `relu(q . k)` in fp32 on these
    ranks keys as vLLM does, up to the order of its fp32 sums."""
    q_fp8, q_scale = quantize_index_queries(q)
    k_fp8, k_scale = quantize_index_keys(k)
    return q_fp8.float() * q_scale[..., None], k_fp8.float() * k_scale[..., None]


def index_logits(q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor,
                 k_scale: torch.Tensor) -> torch.Tensor:
    """Logits `[M, N]` of queries `[M, H, D]` (fp8, their scales folded into `weights [M, H]`) against
    keys `[N, D]` (fp8, scales `[N]`)."""
    dots = torch.einsum("mhd,nd->mhn", q_fp8.float(), k_fp8.float())
    return (dots.relu() * weights.float()[:, :, None]).sum(1) * k_scale.float()[None, :]


def rank_keys(q: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor,
              positions: torch.Tensor, topk: int, softmax_scale: float) -> torch.Tensor:
    """The indexer's choice, as vLLM makes it: queries `[M, H, D]` (any float; quantized here) with
    their head weights `[M, H]` (the `weights_proj` output) against the cached keys `[N, D]` of their
    sequence; query `m` at position `positions[m]` -> its top-`topk` key positions (`causal_topk`)."""
    q_fp8, q_scale = quantize_index_queries(q)
    w = weights.float() * q_scale * (softmax_scale * q.shape[1] ** -0.5)
    return causal_topk(index_logits(q_fp8, w, k_fp8, k_scale), positions, topk)


def causal_topk(logits: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-`topk` key positions `[M, topk]` (int32, -1 where a query has fewer earlier keys) of
    logits `[M, N]` whose query `m` sees keys `0..positions[m]`. Ties go to the earlier key."""
    n = logits.shape[1]
    keys = torch.arange(n, device=logits.device)
    visible = keys[None, :] <= positions[:, None]
    masked = logits.masked_fill(~visible, float("-inf"))
    k = min(topk, n)
    # stable descending sort: among equal logits the earlier position wins, on every host
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    chosen = torch.gather(visible, 1, order)
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32, device=logits.device)
    out[:, :k] = torch.where(chosen, order, -1).to(torch.int32)
    return out


def sparse_mla_attend(q: torch.Tensor, kv: torch.Tensor, selected: torch.Tensor, scale: float,
                      v_dim: int) -> torch.Tensor:
    """Absorbed MLA over selected latent keys: queries `[M, H, C]`, each query's keys `kv [M, K, C]`
    (`selected [M, K]` False where a slot is empty) -> `[M, H, v_dim]`, the latent values being the
    first `v_dim` columns of each key."""
    scores = torch.einsum("mhc,mkc->mhk", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~selected[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("mhk,mkv->mhv", probs, kv[..., :v_dim].float()).to(q.dtype)
