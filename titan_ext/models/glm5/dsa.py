"""DeepSeek Sparse Attention (DSA) for GLM-5, in plain torch.

GLM-5 keeps MLA but lets each query attend only to the `topk` keys that a small
"lightning indexer" scores highest. The indexer is cheap (few heads, ReLU scores,
one shared key per token) and runs without gradients from the LM loss, as in the
reference implementation; the main attention then runs on the selected keys only.

Two implementations of the same function:
- `impl="sparse"` (default): memory-bounded. The indexer scores one chunk of
  queries at a time against the keys it may see (never an S x S matrix); the
  attention runs in MLA's shared latent space (queries absorb W_uk, outputs
  W_uv, so every head reads the same 576-wide key of a selected token) and
  gathers only the selected keys, chunk by chunk, with a hand-written backward
  that recomputes the gather instead of saving it. Memory O(S * topk) indices
  plus O(chunk * topk * latent) scratch: 128k tokens fit on one GPU.
  On CUDA (when Triton imports and the widths are powers of two, as GLM-5's 512 + 64
  are) that attention runs as Triton kernels instead (`sparse_mla_triton`: one program
  per query token, heads as the matmul M dimension, online softmax over the gathered
  keys, fp32 atomics for the key gradients); the chunked torch version stays the CPU
  path and the reference the kernels are tested against. `DSAAttention.sparse_impl`
  says which one the last forward used.
- `impl="dense_mask"`: the selection as a dense S x S boolean mask over SDPA,
  kept as the reference the sparse path is tested against (fine on CPU, O(S^2)).
In fp32 on small sequences both give the same selection and agree to rounding.

Under context parallel (`context_parallel`, `--parallelism.context_parallel_degree`) a rank's
queries run against the whole sequence's gathered latents and indexer keys; both the indexer
and the sparse attention take the queries' global positions as `segments` and mask by them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import LayerNorm
from torchtitan.protocols.module import Module

from vllm_ext.dsa.ops import as_vllm_indexer_sees, quantize_index_keys, quantize_index_queries

from ..context_parallel import chunks, flat_segments, segment_positions
from ..matmul import bmm_fp32
from ..mla import MLAttention


class LightningIndexer(Module):
    """Scores every (query, key) pair cheaply and returns each query's top-k keys."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        q_lora_rank: int
        n_heads: int
        head_dim: int
        rope_dim: int
        topk: int
        linear_init: dict | None = None
        # Queries scored per step; on CUDA each step scores all the keys they may see ([query_chunk, S]
        # fp32), the torch path `key_chunk` at a time ([query_chunk, heads, key_chunk] scratch, merged
        # into a running top-k), never a [queries, S] logits block per head (`indexer_topk`).
        query_chunk: int = 1024
        key_chunk: int = 4096
        # Rank keys from fp8 queries and keys as vLLM's indexer does (`vllm_ext.dsa.ops`), so the
        # trainer attends to the keys the sampler attended to (`configure_indexer`).
        fp8_ranking: bool = False

    def __init__(self, config: Config):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.rope_dim
        self.topk = config.topk
        self.query_chunk = config.query_chunk
        self.key_chunk = config.key_chunk
        self.fp8_ranking = config.fp8_ranking
        init = config.linear_init
        self.wq_b = Linear.Config(
            in_features=config.q_lora_rank, out_features=config.n_heads * config.head_dim, param_init=init
        ).build()
        self.wk = Linear.Config(in_features=config.dim, out_features=config.head_dim, param_init=init).build()
        self.k_norm = LayerNorm.Config(
            normalized_shape=config.head_dim, eps=1e-6, param_init={"weight": nn.init.ones_, "bias": nn.init.zeros_}
        ).build()
        self.weights_proj = Linear.Config(in_features=config.dim, out_features=config.n_heads, param_init=init).build()
        # Frozen, as it runs without gradients: an optimizer then keeps no state for it, the same in a
        # checkpoint as in a resumed run (which would otherwise expect AdamW moments it never made).
        self.requires_grad_(False)
        # Side channel of `titan_ext.replay.replay_index_keys`: the keys inference selected,
        # `[B, L, topk]` for this rank's queries, used instead of this indexer's own choice.
        self.replay_keys_BLK: torch.Tensor | None = None
        self._disagreement: torch.Tensor | None = None  # on the device, as the routers'

    @property
    def disagreement(self) -> float | None:
        """Fraction of queries whose own key set differed from the replayed one (last replayed forward of
        a whole sequence; None under context parallel or without replay)."""
        return None if self._disagreement is None else float(self._disagreement)

    @torch.no_grad()
    def project(self, x: torch.Tensor, q_latent: torch.Tensor, rope: nn.Module, positions):
        """(queries `[B, L, H, D]`, keys `[B, L, D]`, head weights `[B, L, H]` fp32) of these tokens.

        Under context parallel the keys are what travels (gathered with the attention's latents)."""
        bsz, seqlen, _ = x.shape
        q = self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        q_pe, q_rest = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe, k_rest = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_pe, k_pe = rope(q_pe, k_pe, positions)
        q = torch.cat([q_pe, q_rest], dim=-1)
        k = torch.cat([k_pe, k_rest], dim=-1).squeeze(2)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, k, weights

    @torch.no_grad()
    def select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """`[B, L, min(topk, S)]` indices into the `S` keys `k`, each query's highest-scoring ones.

        `segments` (`context_parallel.flat_segments`) give the queries' global positions. Causal:
        later keys score -inf, so a query selects one only when it has fewer than `topk` keys to
        choose from (the attention ignores those)."""
        if q.dtype != torch.float32 and not q.is_cuda:
            q, k = q.float(), k.float()
        topk = min(self.topk, k.size(1))
        replayed = self.replay_keys_BLK
        whole = segments == [0, 0, q.size(1)]
        own = None
        if replayed is None or whole:  # replaying, its own choice only measures the disagreement
            own = indexer_topk(q, k, weights, topk, segments, self.query_chunk, self.key_chunk, self.head_dim**-0.5,
                               self.fp8_ranking)
        if replayed is None:
            return own
        if replayed.shape[:2] != q.shape[:2] or replayed.size(2) < topk:
            raise ValueError(f"replayed indexer keys have shape {tuple(replayed.shape)} but this layer selects "
                             f"{(*q.shape[:2], topk)} (batch, queries, top_k)")
        replayed = replayed[..., :topk].to(device=q.device, dtype=torch.long)
        if own is not None:
            self._disagreement = key_sets_differ(own, replayed).float().mean()
        return replayed

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: nn.Module, positions) -> torch.Tensor:
        """`[B, S, min(topk, S)]` key indices for a whole (unsharded) sequence."""
        q, k, weights = self.project(x, q_latent, rope, positions)
        return self.select(q, k, weights, [0, 0, x.size(1)])


def indexers_of(model: nn.Module) -> list[LightningIndexer]:
    """The model's DSA indexers, in layer order (none for a dense-attention model)."""
    return [m for m in model.modules() if isinstance(m, LightningIndexer)]


def set_indexer_fp8_ranking(model: nn.Module, on: bool) -> int:
    """Switch the indexers of a built model to (or from) vLLM's fp8 ranking; how many it has."""
    indexers = indexers_of(model)
    for m in indexers:
        m.fp8_ranking = on
    return len(indexers)


@contextlib.contextmanager
def recorded_selections(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Every selection the model's indexers make while the context is open, in call order
    (`[B, L, k]` key positions per call): what `moerl mismatch` compares between two rankings."""
    picks: list[torch.Tensor] = []
    indexers = indexers_of(model)

    def recording(select):
        def select_and_record(q, k, weights, segments):
            out = select(q, k, weights, segments)
            picks.append(out)
            return out

        return select_and_record

    for m in indexers:
        m.select = recording(m.select)
    try:
        yield picks
    finally:
        for m in indexers:
            del m.select


def key_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[B, L]` True where two selections `[B, L, k]` of an unsharded sequence (query l at position l)
    pick different sets of the keys each query may see (a pick past the query is an empty slot)."""
    pos = torch.arange(a.shape[1], device=a.device)[None, :, None]
    a, b = (torch.where(t <= pos, t, -1).sort(-1).values for t in (a, b))
    return (a != b).any(-1)


@torch.library.custom_op("titan_ext::dsa_indexer_topk", mutates_args=())
def indexer_topk(
    q_BLHD: torch.Tensor, k_BSD: torch.Tensor, w_BLH: torch.Tensor, topk: int, segments: list[int],
    query_chunk: int, key_chunk: int, scale: float, fp8: bool = False,
) -> torch.Tensor:
    """The indexer's scoring and top-k: `[B, L, topk]` indices into the keys.

    Queries go chunk by chunk (`segments` give their global positions); each chunk scores
    only the keys it may see (at least `topk` of them). On CUDA (`indexer_triton`) a chunk scores
    them all at once (`[B, query_chunk, S]` fp32, 512 MiB at 131k tokens and 1,024 queries) and
    takes one top-k: merging a running top-k over key chunks cost more than the scores (the
    indexer at 131k on the H200, `benchmarks.dsa_layer`: 694 ms merging, 248 ms in one). The torch
    path (CPU) forms every head's scores, so it goes `key_chunk` keys at a time, merging each chunk
    into a running top-k: scratch `[query_chunk, heads, key_chunk]` whatever the sequence length.

    `fp8`: rank as vLLM's indexer does (`vllm_ext.dsa.ops`): fp8 queries and keys with
    power-of-two scales, and equal scores go to the earlier key (fp8 scores tie often: every key
    a query's ReLU zeroes scores 0). CUDA's top-k keeps the earliest of equal values at the
    boundary (a GPU kernel case checks it); the torch path sorts stably.

    One opaque op on purpose: selective activation checkpointing (TorchTitan's default) caches
    the output of every matmul it sees, which here would keep every chunk's score scratch and
    then find it mutated by the in-place ReLU and causal mask. Hidden inside one op, the scratch
    lives only while the op runs; checkpointing recomputes the op like any other cheap op."""
    bsz, seqlen = q_BLHD.shape[:2]
    kernels = _indexer_kernels() if q_BLHD.is_cuda else None
    on_gpu = kernels is not None and kernels.supported(q_BLHD)
    k_scale = None
    if fp8 and on_gpu:  # fp8 values (exact in bf16), the query scales folded into the head weights
        (q_BLHD, q_scale), (k_BSD, k_scale) = quantize_index_queries(q_BLHD), quantize_index_keys(k_BSD)
        q_BLHD, k_BSD, w_BLH = q_BLHD.to(torch.bfloat16), k_BSD.to(torch.bfloat16), w_BLH * q_scale
    elif fp8:
        q_BLHD, k_BSD = as_vllm_indexer_sees(q_BLHD, k_BSD)
    out = torch.empty(bsz, seqlen, topk, dtype=torch.long, device=q_BLHD.device)
    for l0, l1, g0 in chunks(segments, query_chunk):
        kend = min(k_BSD.size(1), max(g0 + l1 - l0, topk))
        if on_gpu:
            scores = kernels.index_scores(q_BLHD[:, l0:l1], k_BSD[:, :kend], w_BLH[:, l0:l1], g0, 0, scale,
                                          None if k_scale is None else k_scale[:, :kend])
            out[:, l0:l1] = scores.topk(min(topk, kend), dim=-1).indices
        else:
            out[:, l0:l1] = _chunk_topk(q_BLHD[:, l0:l1], k_BSD[:, :kend], w_BLH[:, l0:l1], g0, topk, key_chunk,
                                        scale, fp8)
    return out


@indexer_topk.register_fake
def _(q_BLHD, k_BSD, w_BLH, topk, segments, query_chunk, key_chunk, scale, fp8=False):
    return q_BLHD.new_empty(*q_BLHD.shape[:2], topk, dtype=torch.long)


def _chunk_topk(q_BCHD, k_BTD, w_BCH, g0: int, topk: int, key_chunk: int, scale: float,
                earliest_ties: bool = False) -> torch.Tensor:
    """Top-k keys of `c` consecutive queries at global positions g0.. over keys `k_BTD`, a running
    top-k across key chunks (the torch path). With `earliest_ties`, equal scores go to the earlier
    key, as in vLLM's (`vllm_ext.dsa.ops.causal_topk`); a stable sort keeps that across chunks: the
    running best holds only earlier keys, listed before the new chunk's."""
    bsz, c = q_BCHD.shape[:2]
    best_v = best_i = None
    for t0 in range(0, k_BTD.size(1), key_chunk):
        index_scores = _index_scores(q_BCHD, k_BTD[:, t0:t0 + key_chunk], w_BCH, g0, t0, scale)
        keys = torch.arange(t0, t0 + index_scores.size(-1), device=k_BTD.device).expand(bsz, c, -1)
        if best_v is not None:
            index_scores, keys = torch.cat([best_v, index_scores], -1), torch.cat([best_i, keys], -1)
        k = min(topk, index_scores.size(-1))
        if earliest_ties:
            best_v, j = (t[..., :k] for t in torch.sort(index_scores, dim=-1, descending=True, stable=True))
        else:
            best_v, j = index_scores.topk(k, dim=-1)
        best_i = keys.gather(-1, j)
    return best_i


def _index_scores(q_BCHD, k_BTD, w_BCH, g0: int, t0: int, scale: float) -> torch.Tensor:
    """`[B, C, T]` fp32: `scale * sum_h w * relu(q_h . k)` of queries at g0.. and keys at t0..,
    later keys -inf (`indexer_triton.index_scores` on CUDA)."""
    bsz, c, h, d = q_BCHD.shape
    t = k_BTD.size(1)
    # [B*C, H, T]: per-head scores of the chunk; ReLU, then mixed by per-token head weights.
    scores = F.relu_(torch.bmm(q_BCHD.reshape(bsz, c * h, d), k_BTD.transpose(1, 2)).view(bsz * c, h, t))
    w = w_BCH.reshape(bsz * c, 1, h)
    index_scores = bmm_fp32(w.to(scores.dtype), scores)  # fp32 accumulation and result of the head mix
    index_scores = index_scores.view(bsz, c, t) * scale
    pos = torch.arange(g0, g0 + c, device=k_BTD.device)
    keys = torch.arange(t0, t0 + t, device=k_BTD.device)
    return index_scores.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))


@functools.cache
def _indexer_kernels():
    """The indexer_triton module, or None when Triton does not import."""
    try:
        from . import indexer_triton
    except ImportError:
        return None
    return indexer_triton


@functools.cache
def _triton_kernels():
    """The sparse_mla_triton module, or None when Triton does not import."""
    try:
        from . import sparse_mla_triton
    except ImportError:
        return None
    return sparse_mla_triton


def sparse_attention_impl(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> Literal["triton", "torch"]:
    """Which implementation of the sparse latent attention runs for these tensors."""
    if not q.is_cuda:
        return "torch"
    kernels = _triton_kernels()
    return "triton" if kernels is not None and kernels.supported(q, kv, v_dim) else "torch"


class _SparseLatentAttention(torch.autograd.Function):
    """softmax(scale * q k^T over the selected keys) v, in MLA's latent space.

    q_BLHC: queries (W_uk absorbed, rope part appended); kv_BSC: one latent key per
    token whose first `v_dim` channels are also its value; idx_BLK: selected keys
    (entries after the query's position are ignored); `segments` the queries' global
    positions (None: L == S, query i at position i). Chunked over queries; the
    backward recomputes the gathered keys and scatter-adds key gradients in fp32.
    """

    @staticmethod
    def forward(ctx, q_BLHC, kv_BSC, idx_BLK, scale: float, v_dim: int, chunk: int, segments: list[int] | None = None):
        segments = [0, 0, q_BLHC.size(1)] if segments is None else segments
        out, lse = sparse_latent_attention_fwd(q_BLHC, kv_BSC, idx_BLK, scale, v_dim, chunk, segments)
        ctx.save_for_backward(q_BLHC, kv_BSC, idx_BLK, out, lse)
        ctx.scale, ctx.v_dim, ctx.chunk, ctx.segments = scale, v_dim, chunk, segments
        return out

    @staticmethod
    def _probs(q_CHD, kv_TD, idx_CK, g0: int, scale: float, lse_CH=None):
        """Gathered keys, probabilities and LSE of `c` queries at global positions g0.."""
        c, k = idx_CK.shape
        kc = kv_TD.index_select(0, idx_CK.reshape(-1)).view(c, k, kv_TD.size(-1))
        sc = bmm_fp32(q_CHD, kc.transpose(1, 2)).mul_(scale)
        pos = torch.arange(g0, g0 + c, device=idx_CK.device)
        sc.masked_fill_((idx_CK > pos[:, None]).unsqueeze(1), float("-inf"))
        if lse_CH is None:
            lse_CH = torch.logsumexp(sc, dim=-1)
        return kc, sc.sub_(lse_CH.unsqueeze(-1)).exp_(), lse_CH

    @staticmethod
    def backward(ctx, dout_BLHV):
        q_BLHC, kv_BSC, idx_BLK, out, lse = ctx.saved_tensors
        scale, v_dim = ctx.scale, ctx.v_dim
        dtype = q_BLHC.dtype
        dq = torch.empty_like(q_BLHC)
        dkv = torch.zeros(kv_BSC.shape, dtype=torch.float32, device=kv_BSC.device)
        dout_BLHV = dout_BLHV.contiguous()
        for b in range(q_BLHC.size(0)):
            for l0, l1, g0 in chunks(ctx.segments, ctx.chunk):
                qc, ic, doc = q_BLHC[b, l0:l1], idx_BLK[b, l0:l1], dout_BLHV[b, l0:l1]
                kc, p, _ = _SparseLatentAttention._probs(qc, kv_BSC[b], ic, g0, scale, lse[b, l0:l1])
                dp = bmm_fp32(doc, kc[..., :v_dim].transpose(1, 2))
                delta = (doc.float() * out[b, l0:l1].float()).sum(-1, keepdim=True)
                ds = p.mul(dp.sub_(delta)).mul_(scale).to(dtype)
                p = p.to(dtype)
                dq[b, l0:l1] = torch.bmm(ds, kc)
                dkc = bmm_fp32(ds.transpose(1, 2), qc)
                dkc[..., :v_dim] += bmm_fp32(p.transpose(1, 2), doc)
                dkv[b].index_add_(0, ic.reshape(-1), dkc.view(-1, dkc.size(-1)))
        return dq, dkv.to(kv_BSC.dtype), None, None, None, None, None


@torch.library.custom_op("titan_ext::dsa_sparse_latent_attention_fwd", mutates_args=())
def sparse_latent_attention_fwd(
    q_BLHC: torch.Tensor, kv_BSC: torch.Tensor, idx_BLK: torch.Tensor, scale: float, v_dim: int, chunk: int,
    segments: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_SparseLatentAttention`'s forward: (out `[B, L, H, v_dim]`, lse `[B, L, H]` fp32).

    One opaque op for the same reason as `indexer_topk`: selective activation checkpointing
    would otherwise cache every chunk's gathered scores (O(S * heads * topk)) and find them
    mutated by the in-place scale, mask and softmax; the autograd function already saves
    what its backward needs."""
    bsz, seqlen, n_heads, _ = q_BLHC.shape
    out = q_BLHC.new_empty(bsz, seqlen, n_heads, v_dim)
    lse = torch.empty(bsz, seqlen, n_heads, dtype=torch.float32, device=q_BLHC.device)
    for b in range(bsz):
        for l0, l1, g0 in chunks(segments, chunk):
            kc, p, l = _SparseLatentAttention._probs(q_BLHC[b, l0:l1], kv_BSC[b], idx_BLK[b, l0:l1], g0, scale)
            out[b, l0:l1] = torch.bmm(p.to(q_BLHC.dtype), kc[..., :v_dim])
            lse[b, l0:l1] = l
    return out, lse


@sparse_latent_attention_fwd.register_fake
def _(q_BLHC, kv_BSC, idx_BLK, scale, v_dim, chunk, segments):
    out = q_BLHC.new_empty(*q_BLHC.shape[:3], v_dim)
    return out, q_BLHC.new_empty(q_BLHC.shape[:3], dtype=torch.float32)


class DSAAttention(MLAttention):
    """MLA whose queries attend to the indexer's top-k keys (and never to later ones).

    Under context parallel (`cp` set) one all-gather per layer carries the latent kv, the
    roped shared key and the indexer key of every token (`context_parallel`); the indexer
    and the sparse attention then run this rank's queries against the whole sequence."""

    @dataclass(kw_only=True, slots=True)
    class Config(MLAttention.Config):
        indexer: LightningIndexer.Config
        impl: Literal["sparse", "dense_mask"] = "sparse"
        # Queries per step of the sparse attention (bounds its gathered-key scratch).
        query_chunk: int = 256

    def __init__(self, config: Config):
        super().__init__(config)
        self.indexer = config.indexer.build()
        self.impl = config.impl
        self.query_chunk = config.query_chunk
        self.sparse_impl: str | None = None  # "triton" or "torch": what the last sparse forward ran

    def forward(self, x: torch.Tensor, attention_masks: AttentionMasksType, positions: torch.Tensor | None = None):
        if attention_masks is not None:
            raise ValueError("DSAAttention builds its own sparse causal selection; use the sdpa attention backend")
        if self.q_lora_rank == 0:
            raise ValueError("DSA needs a q latent (q_lora_rank > 0)")
        bsz, seqlen, _ = x.shape
        q_latent, q_nope, q_pe, kv, k_pe, positions = self.project(x, positions)
        idx_q, idx_k, idx_w = self.indexer.project(x, q_latent, self.rope, positions)
        if self.cp is None:
            if self.impl == "dense_mask" or self.wkv_b.bias is not None:
                selected = self.indexer.select(idx_q, idx_k, idx_w, [0, 0, seqlen])
                out = self._dense_mask_attention(q_nope, q_pe, kv, k_pe, selected)
                return self.wo(out.reshape(bsz, seqlen, -1))
            kv_all, segments = torch.cat([self.kv_norm(kv), k_pe], dim=-1), None
        else:
            if self.impl != "sparse" or self.wkv_b.bias is not None:
                raise ValueError("context parallel DSA runs the sparse latent attention (impl='sparse', no wkv_b bias)")
            latent = torch.cat([self.kv_norm(kv), k_pe, idx_k.to(kv.dtype)], dim=-1)
            kv_all, idx_k = self.cp.gather(latent).split([latent.size(-1) - idx_k.size(-1), idx_k.size(-1)], dim=-1)
            segments = flat_segments(self.cp.segments(seqlen))
        selected = self.indexer.select(idx_q, idx_k, idx_w, segments or [0, 0, seqlen])
        out = self._sparse_latent_attention(q_nope, q_pe, kv_all, selected, segments)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def _sparse_latent_attention(self, q_nope, q_pe, kv_all, selected, segments):
        """Attention over the selected keys in the shared latent space (absorbed W_uk / W_uv)."""
        n_heads = q_nope.size(2)
        w = self.wkv_b.weight.view(n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
        q_all = torch.cat([q_lat, q_pe], dim=-1)
        self.sparse_impl = sparse_attention_impl(q_all, kv_all, self.kv_lora_rank)
        if self.sparse_impl == "triton":
            positions = None if segments is None else segment_positions(segments, q_all.device)
            o_lat = _triton_kernels().sparse_latent_attention(
                q_all, kv_all, selected, self.softmax_scale, self.kv_lora_rank, positions
            )
        else:
            o_lat = _SparseLatentAttention.apply(
                q_all, kv_all, selected, self.softmax_scale, self.kv_lora_rank, self.query_chunk, segments
            )
        return torch.einsum("bshc,hvc->bshv", o_lat, w_uv)

    def _dense_mask_attention(self, q_nope, q_pe, kv, k_pe, selected):
        """The reference: every head's keys and values materialised, selection as an S x S mask."""
        bsz, seqlen = q_nope.shape[:2]
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, k_nope.size(2), -1)], dim=-1)
        mask = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool, device=q.device)
        mask.scatter_(-1, selected, True)
        mask &= torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask.unsqueeze(1), scale=self.softmax_scale,
        )
        return out.transpose(1, 2)
