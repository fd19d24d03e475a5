"""TorchTitan's MLA attention, plus context parallel over gathered latents (Kimi-K2, and the base of DSA).

Without CP (`cp is None`) the forward is TorchTitan's own. Under CP (`parallelize_mla` sets
`cp`), each rank projects its own tokens, all-gathers only the latent side
(`context_parallel.SequenceShards.gather`: normalised kv latent + roped shared key), expands
keys and values for the whole sequence locally with `wkv_b`, and runs causal attention for
each contiguous run of its global positions against the keys up to that run's end
(`causal_lower_right`: the run's last query sees every key, its first sees all but the run's
other keys), so the masks follow the load-balanced layout and SDPA's kernels still apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.deepseek_v3.model import Attention

from .context_parallel import SequenceShards


class MLAttention(Attention):
    """MLA whose keys come from every rank's latents when `cp` is set."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.cp: SequenceShards | None = None

    def project(self, x: torch.Tensor, positions: torch.Tensor | None):
        """(q latent or None, q_nope, roped q_pe `[B, L, H, *]`, kv latent, roped k_pe `[B, L, rope]`)."""
        bsz, seqlen, _ = x.shape
        if self.cp is not None and positions is None:
            positions = self.cp.positions(seqlen, x.device)
        if self.q_lora_rank == 0:
            q_latent, q = None, self.wq(x)
        else:
            q_latent = self.q_norm(self.wq_a(x))
            q = self.wq_b(q_latent)
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), positions)
        return q_latent, q_nope, q_pe, kv, k_pe.squeeze(2), positions

    def forward(self, x: torch.Tensor, attention_masks: AttentionMasksType, positions: torch.Tensor | None = None):
        if self.cp is None:
            return super().forward(x, attention_masks, positions)
        if attention_masks is not None:
            raise ValueError("context parallel MLA builds its own causal masks; use the sdpa attention backend")
        bsz, seqlen, _ = x.shape
        _, q_nope, q_pe, kv, k_pe, _ = self.project(x, positions)
        latent = self.cp.gather(torch.cat([self.kv_norm(kv), k_pe], dim=-1))
        kv_all, k_pe_all = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_all = self.wkv_b(kv_all).view(bsz, kv_all.size(1), -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_all.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe_all.unsqueeze(2).expand(-1, -1, k_nope.size(2), -1)], dim=-1).transpose(1, 2)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        # On CUDA, values padded to the query width: SDPA's lower-right causal runs the flash kernel
        # only when q, k and v are equally wide (else a memory-efficient one, 3.6x slower on an H200
        # at 32k). The CPU path keeps them as they are (its math kernel, the one-process rounding).
        v = F.pad(v, (0, q.size(-1) - self.v_head_dim if q.is_cuda else 0)).transpose(1, 2)
        outs = []
        for seg in self.cp.segments(seqlen):
            end = seg.global_start + seg.length
            # CausalBias is a tensor subclass, which activation checkpointing's dispatch mode
            # cannot create; it holds no data, so it is made outside the mode.
            with _disable_current_modes():
                causal = causal_lower_right(seg.length, end)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, seg.local_start:seg.local_start + seg.length], k[:, :, :end], v[:, :, :end],
                attn_mask=causal, scale=self.softmax_scale,
            ))
        out = torch.cat(outs, dim=2)[..., :self.v_head_dim].transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)
