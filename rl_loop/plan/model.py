"""titan_ext's model specs and their parameter counts by part.

The architectures are titan_ext's own flavors (``titan_ext.models.glm5`` / ``kimi_k2``), the
very definitions the trainer builds from, imported as any other module: plain dataclasses, without
torch or TorchTitan (``titan_ext.models`` imports those only to build a model), nothing patched.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_ext.models import glm5, kimi_k2
from titan_ext.models.arch import MLAMoEArch

MODELS = ("glm5", "kimi_k2")
_FLAVORS = {"glm5": glm5.FLAVORS, "kimi_k2": kimi_k2.FLAVORS}


def load_arch(model: str, flavor: str = "full") -> MLAMoEArch:
    """The `MLAMoEArch` of titan_ext's `model` / `flavor` (ValueError naming the choices)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; moerl plan knows {', '.join(MODELS)}")
    flavors = _FLAVORS[model]
    if flavor not in flavors:
        raise ValueError(f"unknown flavor {flavor!r} of {model}; it has {', '.join(flavors)}")
    return flavors[flavor]


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one model by part, as TorchTitan's DeepSeek-V3 blocks hold them."""

    attention_per_layer: int  # MLA projections and norms, plus the DSA indexer where there is one
    dense_ffn_per_layer: int
    moe_router_per_layer: int
    routed_experts_per_layer: int
    shared_experts_per_layer: int
    norms_per_layer: int  # attention_norm + ffn_norm
    embedding: int
    output: int  # final norm + LM head
    n_layers: int
    n_dense_layers: int
    num_experts: int
    top_k: int

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def routed_experts(self) -> int:
        return self.routed_experts_per_layer * self.n_moe_layers

    @property
    def total(self) -> int:
        per_layer = self.attention_per_layer + self.norms_per_layer
        moe = self.moe_router_per_layer + self.routed_experts_per_layer + self.shared_experts_per_layer
        return (self.n_layers * per_layer + self.n_dense_layers * self.dense_ffn_per_layer
                + self.n_moe_layers * moe + self.embedding + self.output)

    @property
    def non_expert(self) -> int:
        """Everything FSDP shards over all trainer ranks (the routed experts are sharded by EP first)."""
        return self.total - self.routed_experts

    @property
    def active(self) -> int:
        """Parameters one token touches: all but the routed experts, plus top_k of each layer's."""
        return self.non_expert + self.routed_experts * self.top_k // self.num_experts

    def layer(self, moe: bool) -> int:
        ffn = (self.moe_router_per_layer + self.routed_experts_per_layer + self.shared_experts_per_layer
               if moe else self.dense_ffn_per_layer)
        return self.attention_per_layer + self.norms_per_layer + ffn


def param_counts(arch) -> ParamCounts:
    d, h = arch.dim, arch.n_heads
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    if arch.q_lora_rank:
        q = d * arch.q_lora_rank + arch.q_lora_rank + arch.q_lora_rank * h * qk
    else:
        q = d * h * qk
    kv = d * (arch.kv_lora_rank + arch.qk_rope_head_dim) + arch.kv_lora_rank
    kv += arch.kv_lora_rank * h * (arch.qk_nope_head_dim + arch.v_head_dim)
    attention = q + kv + h * arch.v_head_dim * d
    if arch.has_indexer:  # wq_b, wk, k_norm (weight and bias), weights_proj
        ih, idim = arch.index_n_heads, arch.index_head_dim
        attention += arch.q_lora_rank * ih * idim + d * idim + 2 * idim + d * ih
    expert = 3 * d * arch.moe_hidden_dim
    return ParamCounts(
        attention_per_layer=attention,
        dense_ffn_per_layer=3 * d * arch.dense_hidden_dim,
        moe_router_per_layer=d * arch.num_experts,
        routed_experts_per_layer=arch.num_experts * expert,
        shared_experts_per_layer=arch.num_shared_experts * expert,
        norms_per_layer=2 * d,
        embedding=arch.vocab_size * d,
        output=d + d * arch.vocab_size,
        n_layers=arch.n_layers,
        n_dense_layers=arch.n_dense_layers,
        num_experts=arch.num_experts,
        top_k=arch.top_k,
    )
