"""Architecture hyper-parameters of the MLA + MoE family (DeepSeek-V3, Kimi-K2, GLM-5).

One dataclass holds what both sides of a port need: titan_ext builds its TorchTitan
model config from it, and it maps one-to-one onto the fields of the transformers
config (`DeepseekV3Config`, `GlmMoeDsaConfig`). Keeping the mapping in one place is
what lets `moerl check-parity` build the trainer model straight from a checkpoint's
`config.json`, and lets tiny test checkpoints be made from a titan_ext flavor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as HF configs spell it (`rope_parameters` with rope_type yarn)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class MLAMoEArch:
    """An MLA attention + top-k MoE decoder (dense FFN in the first layers)."""

    hf_architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_dense_layers: int
    dense_hidden_dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    moe_hidden_dim: int
    num_shared_experts: int
    top_k: int
    route_scale: float
    route_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = None
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    # DSA lightning indexer (GLM-5); 0 heads means plain MLA.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    extra_hf: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.n_dense_layers, self.n_layers))

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers `config.json` dict describing this architecture."""
        cfg: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": _MODEL_TYPES[self.hf_architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "first_k_dense_replace": self.n_dense_layers,
            "intermediate_size": self.dense_hidden_dim,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.num_experts,
            "moe_intermediate_size": self.moe_hidden_dim,
            "n_shared_experts": self.num_shared_experts,
            "num_experts_per_tok": self.top_k,
            "routed_scaling_factor": self.route_scale,
            "norm_topk_prob": self.route_norm,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": False,
            "rope_parameters": self._hf_rope_parameters(),
            # vLLM creates e_score_correction_bias only for noaux_tc routing.
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }
        if self.hf_architecture == "DeepseekV3ForCausalLM":
            cfg.update(rope_interleave=True, num_nextn_predict_layers=0)
        if self.has_indexer:
            cfg.update(
                index_n_heads=self.index_n_heads,
                index_head_dim=self.index_head_dim,
                index_topk=self.index_topk,
                # GLM-5's published config: transformers' indexer always rotates interleaved, vLLM's
                # only with this key (it would otherwise take the half-split rope)
                indexer_rope_interleave=True,
            )
        cfg.update(self.extra_hf)
        return cfg

    def _hf_rope_parameters(self) -> dict[str, Any]:
        if self.yarn is None:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, **dataclasses.asdict(self.yarn)}

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "MLAMoEArch":
        """Read a transformers `config.json` dict; unsupported settings raise ValueError."""
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in _MODEL_TYPES:
            raise ValueError(
                f"config.json architecture {arch!r} is not an MLA+MoE model titan_ext ports; "
                f"supported: {sorted(_MODEL_TYPES)}"
            )
        if cfg.get("num_key_value_heads", cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
            raise ValueError("MLA checkpoints must have num_key_value_heads == num_attention_heads")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        yarn = None
        if rope_type == "yarn":
            yarn = YarnScaling(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32.0)),
                beta_slow=float(rope.get("beta_slow", 1.0)),
                mscale=float(rope.get("mscale", 1.0)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 1.0)),
            )
            if yarn.mscale != yarn.mscale_all_dim:
                raise ValueError(
                    "yarn with mscale != mscale_all_dim scales cos/sin, which TorchTitan's "
                    f"ComplexRoPE does not model (got {yarn.mscale} vs {yarn.mscale_all_dim})"
                )
        elif rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (default or yarn)")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("only sigmoid router scores are supported (Kimi-K2, GLM-5)")
        return cls(
            hf_architecture=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_dense_layers=cfg.get("first_k_dense_replace", 0),
            dense_hidden_dim=cfg["intermediate_size"],
            n_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            num_experts=cfg["n_routed_experts"],
            moe_hidden_dim=cfg["moe_intermediate_size"],
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            top_k=cfg["num_experts_per_tok"],
            route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
            route_norm=bool(cfg.get("norm_topk_prob", True)),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            rope_theta=theta,
            yarn=yarn,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            index_n_heads=cfg.get("index_n_heads", 0) if arch == "GlmMoeDsaForCausalLM" else 0,
            index_head_dim=cfg.get("index_head_dim", 0) if arch == "GlmMoeDsaForCausalLM" else 0,
            index_topk=cfg.get("index_topk", 0) if arch == "GlmMoeDsaForCausalLM" else 0,
        )


_MODEL_TYPES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
