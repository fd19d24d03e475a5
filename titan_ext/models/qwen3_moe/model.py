"""Qwen3-MoE (`Qwen3MoeForCausalLM`) on TorchTitan's own Qwen3 MoE blocks.

TorchTitan 0.3.0 ships the blocks (`torchtitan.models.qwen3._build_qwen3_moe_layers`:
GQA with q/k RMSNorm, cos/sin rope, softmax top-k router with top-k renormalisation,
grouped experts) and an HF state-dict adapter, but only for its fixed flavors. Here
the model is built from an HF `config.json`, with the same three changes titan_ext
makes to its MLA models (`builder.py`): maskless causal SDPA (FlexAttention has no
CPU backward), the replaying router (`titan_ext.replay`), and experts that compute in
their input dtype (`experts.NativeDtypeGroupedExperts`), so an fp32 model matches
transformers to rounding and `moerl check-parity --model qwen3_moe` holds at 1e-4.
"""

from __future__ import annotations

from torchtitan.config import derive
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from ...replay import replay_router
from ..experts import NativeDtypeGroupedExperts
from ..state_dict_adapter import MLAMoEStateDictAdapter
from . import Qwen3MoEArch


def build_model_config(arch: Qwen3MoEArch, *, attn_backend: str = "sdpa") -> Qwen3Model.Config:
    """The TorchTitan `Qwen3Model.Config` for `arch` (TorchTitan's blocks, titan_ext's three changes)."""
    layers = _build_qwen3_moe_layers(
        n_layers=arch.n_layers,
        dim=arch.dim,
        n_heads=arch.n_heads,
        n_kv_heads=arch.n_kv_heads,
        head_dim=arch.head_dim,
        moe_hidden_dim=arch.moe_hidden_dim,
        num_experts=arch.num_experts,
        top_k=arch.top_k,
        fuse_qkv=False,  # the HF adapter maps q/k/v_proj onto separate wq/wk/wv
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=arch.max_seq_len, theta=arch.rope_theta),
    )
    for layer in layers:
        for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.qk_norm):
            norm.eps = arch.norm_eps
        layer.attention.inner_attention = (
            ScaledDotProductAttention.Config() if attn_backend == "sdpa" else FlexAttention.Config()
        )
        # Qwen3-MoE has no load-balancing bias (aux loss instead): select exactly as the checkpoint does.
        layer.moe.load_balance_coeff = None
        layer.moe.router = replay_router(layer.moe.router)
        experts = layer.moe.routed_experts
        experts.inner_experts = derive(experts.inner_experts, NativeDtypeGroupedExperts.Config)
    norm = _qwen3_norm(arch.dim)
    norm.eps = arch.norm_eps
    return Qwen3Model.Config(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        norm=norm,
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=arch.dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=arch.dim, out_features=arch.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


class Qwen3MoEStateDictAdapter(Qwen3StateDictAdapter):
    """TorchTitan's Qwen3 adapter plus the same refusal of missing/extra/mis-shaped tensors as the MLA one."""

    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)

    def drop_mtp(self, hf_keys):
        return dict(hf_keys)  # Qwen3-MoE has no MTP layers

    check_hf_shapes = MLAMoEStateDictAdapter.check_hf_shapes


__all__ = ["Qwen3MoEStateDictAdapter", "build_model_config"]
