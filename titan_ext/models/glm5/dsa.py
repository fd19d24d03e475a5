"""DeepSeek Sparse Attention (DSA) for GLM-5, in plain torch.

GLM-5 keeps MLA but lets each query attend only to the `topk` keys that a small
"lightning indexer" scores highest. The indexer is cheap (few heads, ReLU scores,
one shared key per token) and runs without gradients from the LM loss, as in the
reference implementation; the main attention then runs on the selected keys only.

Here the selection is applied as a boolean mask to SDPA: exact on any device and
simple to check against transformers; a gather-based kernel is a speed concern for
the GPU benchmarks, not for correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import LayerNorm
from torchtitan.models.deepseek_v3.model import Attention
from torchtitan.protocols.module import Module


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

    def __init__(self, config: Config):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.rope_dim
        self.topk = config.topk
        init = config.linear_init
        self.wq_b = Linear.Config(
            in_features=config.q_lora_rank, out_features=config.n_heads * config.head_dim, param_init=init
        ).build()
        self.wk = Linear.Config(in_features=config.dim, out_features=config.head_dim, param_init=init).build()
        self.k_norm = LayerNorm.Config(
            normalized_shape=config.head_dim, eps=1e-6, param_init={"weight": nn.init.ones_, "bias": nn.init.zeros_}
        ).build()
        self.weights_proj = Linear.Config(in_features=config.dim, out_features=config.n_heads, param_init=init).build()

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: nn.Module, positions) -> torch.Tensor:
        """Returns `[B, S, min(topk, S)]` key indices; causal (a query never selects a later key)."""
        bsz, seqlen, _ = x.shape
        q = self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        q_pe, q_rest = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe, k_rest = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_pe, k_pe = rope(q_pe, k_pe, positions)
        q = torch.cat([q_pe, q_rest], dim=-1).float()
        k = torch.cat([k_pe, k_rest], dim=-1).squeeze(2).float()
        # [B, S, H, T]: per-head ReLU scores, mixed by per-token head weights.
        scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * self.head_dim**-0.5)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        index_scores = torch.einsum("bsh,bsht->bst", weights, scores)
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        index_scores = index_scores.masked_fill(~causal, float("-inf"))
        return index_scores.topk(min(self.topk, seqlen), dim=-1).indices


class DSAAttention(Attention):
    """MLA whose queries attend to the indexer's top-k keys (and never to later ones)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        indexer: LightningIndexer.Config

    def __init__(self, config: Config):
        super().__init__(config)
        self.indexer = config.indexer.build()

    def forward(self, x: torch.Tensor, attention_masks: AttentionMasksType, positions: torch.Tensor | None = None):
        if attention_masks is not None:
            raise ValueError("DSAAttention builds its own sparse causal mask; use the sdpa attention backend")
        if self.q_lora_rank == 0:
            raise ValueError("DSA needs a q latent (q_lora_rank > 0)")
        bsz, seqlen, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), positions)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)

        selected = self.indexer(x, q_latent, self.rope, positions)
        mask = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool, device=x.device)
        mask.scatter_(-1, selected, True)
        mask &= torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask.unsqueeze(1), scale=self.softmax_scale,
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
